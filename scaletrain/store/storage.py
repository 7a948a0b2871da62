"""Run directories on a local disk or in Cloud Storage (`gs://bucket/path`).

On a multi-host slice every worker must reach the checkpoints, and a preempted slice's disks are gone with it, so
a launched run's directory is in a bucket. Orbax writes there itself (tensorstore for the arrays, etils.epath and
gcsfs for its small files), and config.yaml is one write. What grows by appending - metrics.jsonl and TensorBoard's
event files - cannot grow in place in an object store: `Mirror` writes it in a local folder and uploads the
changed files whole.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from etils import epath

from scaletrain.errors import UserError, first_line

REMOTE_PREFIX = "gs://"
# Seconds between uploads of a gs:// run directory's growing files (metrics, goodput).
SYNC_EVERY_S = 60
# Seconds a bucket has to answer its first request, credentials found included. Cloud Storage's libraries retry an
# unreachable endpoint with backoff for a minute and more, then raise from deep inside; a bucket that cannot answer
# a one-object listing in this time is said to be unreachable at once.
PROBE_TIMEOUT_S = 10.0
_answered: set[str] = set()  # the buckets this process has heard from
_EXPECTED = ("expected a bucket this machine can reach: check its name, the network, and the credentials (gcloud "
             "auth application-default login, or the VM's service account)")


def is_remote(location: str | os.PathLike) -> bool:
    return str(location).startswith(REMOTE_PREFIX)


def path(location: str | os.PathLike) -> epath.Path:
    """A gs:// location as is, once its bucket has answered (probe); a local one made absolute (Orbax wants
    absolute paths)."""
    if is_remote(location):
        probe(location)
        return epath.Path(location)
    return epath.Path(os.path.abspath(location))


def probe(location: str | os.PathLike) -> None:
    """Nothing for a local location. For a gs:// one, UserError within PROBE_TIMEOUT_S unless its bucket answers a
    one-object listing: it does not exist, it refuses these credentials, or nothing answers. Once per bucket and
    process: the callers are the first touches of a path (a run directory, data.path, a tokenizer, init_from)."""
    if not is_remote(location):
        return
    bucket = str(location)[len(REMOTE_PREFIX):].split("/", 1)[0]
    if bucket in _answered:
        return
    import threading

    from fsspec import asyn
    from gcsfs.core import GCSFileSystem  # the JSON API alone, without the extended one's gRPC clients

    outcome: dict = {"stage": "while finding credentials"}

    def ask() -> None:  # in a thread of its own: finding credentials cannot be cut short from outside
        try:  # a client of its own: fsspec's cached one keeps the endpoint and credentials it was made with
            fs = GCSFileSystem(skip_instance_cache=True)
            outcome["stage"] = "to a one-object listing"
            # One request, not _request's retries with backoff (a minute): its own error, or the answer, at once.
            asyn.sync(fs.loop, GCSFileSystem._request.__wrapped__, fs, "GET", "b/{}/o", bucket, maxResults=1)
            outcome["answered"] = True
        except Exception as e:  # noqa: BLE001 - said below, in one line
            outcome["error"] = e

    asking = threading.Thread(target=ask, name="scaletrain-bucket-probe", daemon=True)
    asking.start()
    asking.join(PROBE_TIMEOUT_S)
    if outcome.get("answered"):
        _answered.add(bucket)
        return
    error = outcome.get("error")
    if error is None:
        raise UserError(f"{location}: Cloud Storage did not answer within {PROBE_TIMEOUT_S:g} s ({outcome['stage']}); "
                        f"{_EXPECTED}")
    if isinstance(error, FileNotFoundError):
        raise UserError(f"{location}: there is no bucket gs://{bucket}; expected an existing bucket (gcloud storage "
                        f"buckets create gs://{bucket})")
    raise UserError(f"{location}: cannot reach gs://{bucket} ({type(error).__name__}: {first_line(error)[:160]}); "
                    f"{_EXPECTED}")


def resolve(location: str, base: str | os.PathLike) -> str:
    """`location` as a run directory's config names it: a relative path that exists under `base` (the folder of
    the config, local or gs://) is taken there, so a moved or copied run still finds what it keeps (a converted
    run's tokenizer/); anything else - absolute, gs://, a name such as `bytes`, a path relative to the working
    directory as configs written by hand use - is returned as it is."""
    if not location or is_remote(location) or os.path.isabs(location):
        return location
    candidate = path(base) / location
    return str(candidate) if candidate.exists() else location


def prepare(location: str | os.PathLike) -> epath.Path:
    """The run directory, created if local. An object store has no directories, and creating one there could
    create a bucket by mistake: a missing bucket must fail at the first write instead."""
    directory = path(location)
    if not is_remote(location):
        directory.mkdir(parents=True, exist_ok=True)
    return directory


class Mirror:
    """A local folder standing in for a run directory, for files written by appending. Locally it is the run
    directory itself. For a gs:// one it is a temporary folder: `fetch` copies a remote file down (metrics.jsonl,
    which a resumed run continues), `sync` uploads each file that changed since the last upload. An upload that
    fails is said once and retried at the next sync: a metrics file must never stop a training run."""

    def __init__(self, location: str | os.PathLike):
        self.remote = path(location) if is_remote(location) else None
        self.local = Path(tempfile.mkdtemp(prefix="scaletrain-run-")) if self.remote else Path(location)
        self._sent: dict[Path, tuple[int, int]] = {}  # relative path -> (size, mtime) at its last upload
        self._warned = False

    def fetch(self, name: str) -> None:
        if self.remote is not None and (self.remote / name).exists():
            (self.local / name).write_bytes((self.remote / name).read_bytes())

    def sync(self) -> None:
        if self.remote is None:
            return
        for file in sorted(p for p in self.local.rglob("*") if p.is_file()):
            relative, stat = file.relative_to(self.local), file.stat()
            version = (stat.st_size, stat.st_mtime_ns)
            if self._sent.get(relative) == version:
                continue
            try:
                (self.remote / str(relative)).write_bytes(file.read_bytes())
            except Exception as e:  # noqa: BLE001 - any storage error: warn, keep training, retry next time
                if not self._warned:
                    print(f"warning: cannot upload {relative} to {self.remote} ({type(e).__name__}: "
                          f"{first_line(e)}); retrying at the next sync",
                          file=sys.stderr, flush=True)
                    self._warned = True
                continue
            self._sent[relative] = version

    def close(self) -> None:
        self.sync()
        if self.remote is not None:
            shutil.rmtree(self.local, ignore_errors=True)
