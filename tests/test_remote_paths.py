"""A gs:// path whose bucket cannot be reached - `status`, a run directory, `data.path`, `checkpoint.init_from`,
`data prepare --input` - is one `error:` line within seconds (storage.probe), not a minute of the libraries'
retries ending in a traceback, nor a wrong reason ("not a run directory")."""

import json
import os
import socket
import subprocess
import sys

import pytest

from scaletrain.store import storage
from tests.conftest import ROOT, run_main


@pytest.fixture
def fresh_probe(monkeypatch):
    monkeypatch.setattr(storage, "_answered", set())
    monkeypatch.setattr(storage, "PROBE_TIMEOUT_S", 3.0)  # the real 10 s, shortened for the suite


# Each command run in one process of its own (a failed probe's thread retries on in the background, and a client
# made meanwhile keeps the dead endpoint: later tests in this process would wait minutes on it), with the probe's
# timeout shortened to 3 s: (exit status, stderr, seconds) each, as JSON.
DRIVER = """
import contextlib, io, json, sys, time
from scaletrain.__main__ import main
from scaletrain.store import storage
storage.PROBE_TIMEOUT_S = 3.0
out = []
for command in json.loads(sys.argv[1]):
    storage._answered.clear()
    err, began = io.StringIO(), time.monotonic()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(command)
    out.append((code, err.getvalue(), time.monotonic() - began))
print(json.dumps(out))
"""
COMMANDS = [
    ["status", "gs://unreachable/run"],
    ["data", "prepare", "--tokenizer", "bytes", "--input", "gs://unreachable/corpus/*.txt", "--out", "{tmp}/ds"],
    ["train", "--config", "configs/llama_tiny.yaml", "--set", "data.source=files", "--set",
     "data.path=gs://unreachable/c.jsonl", "--set", "run_dir={tmp}/run"],
    ["train", "--config", "configs/llama_tiny.yaml", "--set", "checkpoint.init_from=gs://unreachable/run", "--set",
     "run_dir={tmp}/run"],
    ["train", "--config", "configs/llama_tiny.yaml", "--set", "run_dir=gs://unreachable/run"],
]


def test_an_unreachable_bucket_is_one_line_at_once(tmp_path):
    """Cloud Storage's endpoint a local port nobody listens on: every entry point says so in one line, within the
    probe's timeout, having written nothing."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "STORAGE_EMULATOR_HOST": f"http://localhost:{port}", "FSSPEC_GS_TOKEN": "anon",
           "TENSORSTORE_GCS_HTTP_URL": f"http://localhost:{port}", "JAX_PLATFORMS": "cpu"}
    commands = [[a.format(tmp=tmp_path) for a in c] for c in COMMANDS]
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(commands)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for command, (code, err, seconds) in zip(commands, json.loads(proc.stdout.splitlines()[-1])):
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1, (command, err)
        assert "Cloud Storage did not answer within 3 s" in lines[0] and "credentials" in lines[0], lines[0]
        assert seconds < 15, (command, seconds)
    assert not (tmp_path / "run").exists() and not (tmp_path / "ds").exists()


def test_a_missing_bucket_is_named_as_such(bucket, capfd, fresh_probe):
    result = run_main(["status", "gs://no-such-bucket/run"], capfd, module=True)
    assert result.returncode == 2
    assert result.stderr.startswith("error: gs://no-such-bucket/run: there is no bucket gs://no-such-bucket")


def test_a_reachable_bucket_is_asked_once(bucket, capfd, fresh_probe, monkeypatch):
    """The emulator's bucket answers: a run directory that is not there is that, not an unreachable bucket; a
    second look asks nothing more."""
    result = run_main(["status", f"{bucket}/nothing-here"], capfd, module=True)
    assert result.returncode == 2 and "is not a run directory (no config.yaml)" in result.stderr
    monkeypatch.setattr(storage, "PROBE_TIMEOUT_S", 0.0)  # any new probe would now fail
    storage.path(f"{bucket}/elsewhere")


def test_the_probe_answers_within_the_issues_15_seconds():
    assert storage.PROBE_TIMEOUT_S <= 10
