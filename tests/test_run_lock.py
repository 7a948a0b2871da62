"""One writer per run directory: a second run is refused, a dead run's lock is taken over, a lost lock is noticed."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from scaletrain.store import run_lock
from scaletrain.store.run_lock import FILE_NAME, RunDirInUse, RunLock
from tests.conftest import ROOT


def test_a_second_run_is_refused_until_the_first_releases(tmp_path):
    first = RunLock(str(tmp_path))
    with pytest.raises(RunDirInUse, match=rf"is in use by process {os.getpid()} on .*; wait for that run to end"):
        RunLock(str(tmp_path))
    first.release()
    assert not (tmp_path / FILE_NAME).exists()  # a finished run leaves its directory as it found it
    RunLock(str(tmp_path)).release()


def test_a_killed_run_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from scaletrain.store.run_lock import RunLock; RunLock(sys.argv[1]); "
                               "print('held', flush=True); time.sleep(600)", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(RunDirInUse, match=f"process {holder.pid} "):
        RunLock(str(tmp_path))
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (tmp_path / FILE_NAME).exists()  # left behind, but no process holds it
    RunLock(str(tmp_path)).release()


def _write_object(bucket_path: str, record: dict) -> None:
    import gcsfs

    gcsfs.GCSFileSystem().pipe_file(bucket_path.removeprefix("gs://"), json.dumps(record).encode())


def test_a_bucket_lock_is_refused_taken_over_when_stale_and_noticed_when_lost(bucket, monkeypatch, capsys):
    run_dir = f"{bucket}/locked"
    first = RunLock(run_dir)
    with pytest.raises(RunDirInUse, match=rf"in use by process {os.getpid()} .*if it died, its lock is taken over in "
                                          rf"1(19|20) s\)"):
        RunLock(run_dir)
    first.release()

    # A holder silent for longer than STALE_AFTER_S died: its lock is taken over, and said so.
    _write_object(f"{run_dir}/{FILE_NAME}", {"host": "gone", "pid": 1, "started": "then",
                                             "heartbeat": time.time() - run_lock.STALE_AFTER_S - 1})
    second = RunLock(run_dir)
    assert "took over the lock of run_dir" in capsys.readouterr().err
    second.release()

    # A holder that was a process of this host, now gone (SIGKILLed, restarted here), is dead at once.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_object(f"{run_dir}/{FILE_NAME}", {"host": socket.gethostname(), "pid": dead.pid, "started": "then",
                                             "heartbeat": time.time()})
    RunLock(run_dir).release()
    assert "took over the lock of run_dir" in capsys.readouterr().err

    # A holder whose lock was taken over while it was cut off learns it at its next heartbeat.
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    third = RunLock(run_dir)
    _write_object(f"{run_dir}/{FILE_NAME}", {"host": "usurper", "pid": 2, "started": "now", "heartbeat": time.time()})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            third.check()
        except RunDirInUse as e:
            assert "in use by process 2 on usurper" in str(e)
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the lost lock went unnoticed")
    third.release()  # leaves the usurper's lock alone
    with pytest.raises(RunDirInUse, match="usurper"):
        RunLock(run_dir)
