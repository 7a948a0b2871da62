"""A gs:// path whose bucket cannot be reached - `status`, a run directory, `data.path`, `checkpoint.init_from`,
`data prepare --input` - is one `error:` line within seconds (storage.probe), not a minute of the libraries'
retries ending in a traceback, nor a wrong reason ("not a run directory")."""

import socket
import time

import pytest

from scaletrain.store import storage
from tests.conftest import run_cli, run_main


@pytest.fixture
def fresh_probe(monkeypatch):
    monkeypatch.setattr(storage, "_answered", set())
    monkeypatch.setattr(storage, "PROBE_TIMEOUT_S", 3.0)  # the real 10 s, shortened for the suite


def _endpoint(monkeypatch, port: int) -> None:
    for name in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL"):
        monkeypatch.setenv(name, f"http://localhost:{port}")
    monkeypatch.setenv("FSSPEC_GS_TOKEN", "anon")
    # As the bucket fixture has it: gcsfs reads it when first imported, maybe here, and its default would have a
    # later test's client ask the emulator for a gRPC API it has not.
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


@pytest.fixture
def nothing_answers(monkeypatch, fresh_probe):
    """Cloud Storage's endpoint a local port nobody listens on: every connection refused."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    _endpoint(monkeypatch, port)


@pytest.mark.parametrize("command", [
    ["status", "gs://unreachable/run"],
    ["data", "prepare", "--tokenizer", "bytes", "--input", "gs://unreachable/corpus/*.txt", "--out", "{tmp}/ds"],
    ["data", "prepare", "--tokenizer", "gs://unreachable/tokenizer.json", "--input", "{tmp}", "--out", "{tmp}/ds"],
    ["train", "--config", "configs/llama_tiny.yaml", "--set", "data.source=files", "--set",
     "data.path=gs://unreachable/c.jsonl", "--set", "run_dir={tmp}/run"],
    ["train", "--config", "configs/llama_tiny.yaml", "--set", "checkpoint.init_from=gs://unreachable/run", "--set",
     "run_dir={tmp}/run"],
    ["train", "--config", "configs/llama_tiny.yaml", "--set", "run_dir=gs://unreachable/run"],
])
def test_an_unreachable_bucket_is_one_line_at_once(tmp_path, capfd, nothing_answers, command):
    began = time.monotonic()
    result = run_main([a.format(tmp=tmp_path) for a in command], capfd, module=True)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: gs://unreachable/") and "cannot reach gs://unreachable (" in lines[0]
    assert "credentials" in lines[0]
    assert time.monotonic() - began < 15
    assert not (tmp_path / "ds").exists()


def test_the_command_line_says_it_in_one_line(nothing_answers):
    """In a process of its own, with the real timeout: nothing else on stderr, exit status 2, within 15 s."""
    began = time.monotonic()
    result = run_cli(["status", "gs://unreachable/run"], module=True, timeout=60)
    assert time.monotonic() - began < 15
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: gs://unreachable/run: cannot reach gs://unreachable")


def test_an_endpoint_that_never_answers_is_given_the_timeout(capfd, fresh_probe, monkeypatch):
    """A server that takes the connection and never answers: the probe's timeout, not the libraries' minutes."""
    with socket.socket() as silent:
        silent.bind(("localhost", 0))
        silent.listen()
        _endpoint(monkeypatch, silent.getsockname()[1])
        began = time.monotonic()
        result = run_main(["status", "gs://unreachable/run"], capfd, module=True)
        assert time.monotonic() - began < 6
    assert result.returncode == 2
    assert result.stderr.startswith("error: gs://unreachable/run: Cloud Storage did not answer within 3 s")


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
