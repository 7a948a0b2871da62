"""One writer per run directory: a lock held for a training run's life.

Two runs writing one run directory destroy each other's work: the second's checkpoint manager removes the first's
save in progress as a leftover, both rewrite metrics.jsonl. So a run takes `RUN_DIR/run.lock` before it reads or
writes anything there, and a second run is refused with one line naming the holder.

- Local directory: an exclusive `flock` on the file. The kernel drops it when the holding process dies, however it
  dies, so a killed run never leaves a stale lock. (Some network filesystems do not implement `flock`; use a local
  disk or a bucket.)
- Bucket (gs://): an object created only if absent (`ifGenerationMatch=0`). The holder rewrites it every
  HEARTBEAT_S seconds, each write conditional on the generation it last wrote, so it notices if another run has
  taken the lock. A lock whose heartbeat is older than STALE_AFTER_S, or whose holder was a process of this host
  that no longer exists, belongs to a run that died: a new run takes it over by a write conditional on the stale
  generation, so of several runs trying at once exactly one wins.
The lock is removed when the run ends (normally, by an error or by SIGTERM), and with it a run directory this run
created and left empty.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
import threading
import time

from scaletrain.errors import UserError
from scaletrain.store import storage

FILE_NAME = "run.lock"
HEARTBEAT_S = 15.0
STALE_AFTER_S = 120.0  # eight missed heartbeats: the holder is gone (or cut off, and will find its lock taken)


class RunDirInUse(UserError):
    pass


def _holder_record() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "heartbeat": time.time()}


def _in_use(location: str, holder: dict | None, stale_in: float | None = None) -> RunDirInUse:
    who = (f"process {holder.get('pid')} on {holder.get('host')}, running since {holder.get('started')}"
           if holder else "another run")
    wait = "wait for that run to end" if stale_in is None else \
        f"wait for that run to end (if it died, its lock is taken over in {stale_in:.0f} s)"
    return RunDirInUse(f"run_dir '{location}' is in use by {who} ({FILE_NAME}); {wait}, or give this one another "
                       f"run_dir")


class _LocalLock:
    def __init__(self, path: str, location: str):
        self.path = path
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise _in_use(location, self._read()) from None
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # the holder removed the file between our open and flock: ours is a dead copy; again
        self.fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(_holder_record()).encode())

    def _read(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.loads(f.read())
        except (OSError, ValueError):  # removed or half-written meanwhile: the holder is unnamed
            return None

    def check(self) -> None:
        pass  # a flock cannot be taken away while its holder lives

    def release(self) -> None:
        os.unlink(self.path)  # before unlocking: a waiter that opened this file sees it is gone and retries
        os.close(self.fd)


def _may_live(holder: dict) -> bool:
    """False only for a holder known dead: a process of this host that no longer exists. (A reused pid reads as
    alive: the lock then waits to go stale, the safe side.)"""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return True
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class _BucketLock:
    def __init__(self, path: str, location: str):
        import gcsfs

        self.fs = gcsfs.GCSFileSystem()
        self.bucket, self.key, _ = self.fs.split_path(path)
        self.location = location
        self.lost: dict | None = None
        try:
            self.generation = self._write(if_generation=0)
        except FileExistsError:
            holder, generation = self._read()
            silent = time.time() - holder.get("heartbeat", 0) if holder is not None else None
            if silent is not None and silent < STALE_AFTER_S and _may_live(holder):
                raise _in_use(location, holder, STALE_AFTER_S - silent) from None
            try:  # stale, or deleted meanwhile (generation 0): take it over, unless another run does first
                self.generation = self._write(if_generation=generation)
            except FileExistsError:
                raise _in_use(location, self._read()[0]) from None
            if holder is not None:
                print(f"warning: took over the lock of run_dir '{location}' from {holder.get('host')} "
                      f"(pid {holder.get('pid')}), silent for {time.time() - holder['heartbeat']:.0f} s",
                      file=sys.stderr, flush=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def _write(self, if_generation: int) -> int:
        obj = self.fs.call("POST", f"{self.fs._location}/upload/storage/v1/b/{self.bucket}/o",
                           uploadType="media", name=self.key, ifGenerationMatch=str(if_generation),
                           data=json.dumps(_holder_record()).encode(),
                           headers={"Content-Type": "application/octet-stream"}, json_out=True)
        return int(obj["generation"])

    def _read(self) -> tuple[dict | None, int]:
        """(holder, generation); generation 0 when there is no lock object."""
        try:
            generation = int(self.fs.info(f"{self.bucket}/{self.key}", refresh=True)["generation"])
            holder = json.loads(self.fs.cat_file(f"{self.bucket}/{self.key}", generation=generation))
        except FileNotFoundError:
            return None, 0
        except ValueError:
            holder = None
        return holder, generation

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.generation = self._write(if_generation=self.generation)
            except FileExistsError:
                self.lost = self._read()[0] or {}
                return
            except Exception:  # noqa: BLE001 - a network hiccup: the next heartbeat tries again
                continue

    def check(self) -> None:
        if self.lost is not None:
            raise _in_use(self.location, self.lost)

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.lost is None:
            try:
                self.fs.call("DELETE", "b/{}/o/{}", self.bucket, self.key, ifGenerationMatch=str(self.generation))
            except (FileNotFoundError, FileExistsError):
                pass  # taken over meanwhile: it is no longer ours to remove


class RunLock:
    """The lock of one run directory, held from `acquire` to `release`."""

    def __init__(self, location: str):
        # A local directory made here and still empty at release goes again: a refused run leaves nothing.
        self._made = None if storage.is_remote(location) or storage.path(location).exists() else location
        directory = storage.prepare(location)
        path = str(directory / FILE_NAME)
        self._lock = (_BucketLock if storage.is_remote(location) else _LocalLock)(path, str(location))

    def check(self) -> None:
        """Raises RunDirInUse if another run has taken the lock over (a bucket lock whose heartbeats stalled)."""
        self._lock.check()

    def release(self) -> None:
        self._lock.release()
        if self._made is not None:
            try:
                os.rmdir(self._made)
            except OSError:  # not empty: the run wrote something
                pass
