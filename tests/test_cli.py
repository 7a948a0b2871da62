"""Bad input: exit status 2 and one `error:` line on stderr, no traceback, nothing written (README.md)."""

import os

import pytest

from tests.conftest import ROOT, run_cli, run_main, tiny_overrides


def _args(tmp_path, *extra):
    sets = tiny_overrides(tmp_path / "run", **{"mesh.fsdp": -1, "steps": 2}) + list(extra)
    return ["--config", "configs/llama_tiny.yaml", "--cpu-devices", "8"] + [a for s in sets for a in ("--set", s)]


@pytest.mark.parametrize("extra, message", [
    (["mesh.fdsp=4"], "unknown config key 'mesh.fdsp'; did you mean 'mesh.fsdp'?"),
    (["steps=abc"], "steps must be a number"),
    (["mesh.fsdp=4"], "multiply to 4"),
    (["mesh.tensor=4", "model.num_heads=6", "model.num_kv_heads=6"],
     "model.num_heads=6 is not divisible by mesh.tensor=4"),
    (["mesh.pipeline=8", "model.num_layers=2"], "model.num_layers=2 is not divisible by mesh.pipeline=8"),
    (["data.source=files", "data.path=/nonexistent/corpus.jsonl"],
     "data.path '/nonexistent/corpus.jsonl' matches no files"),
    (["train.global_batch=12"], "not divisible by mesh.data x mesh.fsdp = 8"),
])
def test_invalid_input_exits_2_with_one_error_line(tmp_path, extra, message, capfd):
    """One case in a process of its own, as a user meets it (JAX started, nothing else on stderr); the others in
    this process (conftest.run_main: the same main(), without a process start each)."""
    args = _args(tmp_path, *extra)
    result = run_cli(args) if message == "multiply to 4" else run_main(args, capfd)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("error: "), result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args, module, message", [
    (["--config", "configs/missing.yaml"], False, "error: config file 'configs/missing.yaml' not found"),
    (["--config", "configs/llama_tiny.yaml", "--bogus"], False, "error: unrecognized arguments: --bogus"),
    (["train", "--config", "configs/llama_tiny.yaml", "--set", "steps=-1"], True, "error: steps must be > 0"),
    (["frobnicate"], True, "error: argument command: invalid choice: 'frobnicate'"),
])
def test_cli_usage_errors(args, module, message):
    result = run_cli(args, module=module)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [result.stderr.splitlines()[0]]
    assert result.stderr.startswith(message), result.stderr


@pytest.mark.parametrize("command, out, message", [
    ("logits", "file.npy", "already exists; expected a new path (nothing is overwritten)"),
    ("logits", "missing/logits.npy", "missing does not exist; create it or correct the path"),
    ("logits", "logits.bin", "expected a path ending in .npy"),
    ("fold", "file.npy", "already exists as a file; expected a new path or an existing empty folder"),
    ("fold", "full", "is a folder that is not empty"),
    ("fold", "missing/run", "missing does not exist"),
    ("sweep", "file.npy", "already exists as a file; expected a new path or an existing folder"),
    ("sweep", "missing/out", "missing does not exist"),
])
def test_out_that_would_replace_something_or_lies_in_a_missing_folder(tmp_path, capsys, command, out, message):
    """Refused before anything is restored or compiled: here the run directory does not even exist."""
    from scaletrain.__main__ import main

    (tmp_path / "file.npy").write_bytes(b"mine")
    (tmp_path / "t.npy").write_bytes(b"")  # read after --out is checked
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.yaml").write_text("mine")
    (tmp_path / "sweep.yaml").write_text(f"base: {ROOT / 'configs' / 'llama_tiny.yaml'}\nstages: [run]\n"
                                         f"variants: [{{steps: 1}}]\n")
    head = {"logits": ["logits", "--run-dir", str(tmp_path / "run"), "--tokens", str(tmp_path / "t.npy")],
            "fold": ["convert", "fold-norms", "--run-dir", str(tmp_path / "run")],
            "sweep": ["sweep", str(tmp_path / "sweep.yaml")]}[command]
    assert main([*head, "--out", str(tmp_path / out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {tmp_path / out}") and err.count("\n") == 1 and message in err, err
    assert (tmp_path / "file.npy").read_bytes() == b"mine" and (tmp_path / "full" / "config.yaml").read_text() == "mine"


@pytest.fixture
def no_bucket(monkeypatch):
    """Every gs:// access (etils.epath's fsspec backend: gcsfs) raises: what a command checks before it reads or
    writes a bucket, it checks without one."""
    from etils.epath import backend

    def asked(self, name):
        raise AssertionError(f"the command asked a bucket ({name}://) before its local checks")

    monkeypatch.setattr(backend._FileSystemSpecBackend, "_get_filesystem", asked)
    # What `convert` sets before JAX starts (runtime.configure), for this test only.
    for name, value in (("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_ACCELERATOR_TYPE", "v5p-8")):
        monkeypatch.setenv(name, os.environ.get(name, value))


@pytest.mark.parametrize("command, message", [
    (["data", "prepare", "--tokenizer", "bytes", "--input", "{tmp}/a.txt", "--out", "gs://b/ds"],
     "--out gs://b/ds: a prepared dataset is written to (and read from) a local disk; expected a local path"),
    (["convert", "to-hf", "--run-dir", "gs://b/run", "--out", "gs://b/hf"],
     "--out gs://b/hf: to-hf writes a local folder; expected a local path"),
    (["logits", "--run-dir", "gs://b/run", "--tokens", "{tmp}/t.npy", "--out", "gs://b/l.npy"],
     "--out gs://b/l.npy: logits writes a local .npy file; expected a local path"),
    (["logits", "--run-dir", "gs://b/run", "--tokens", "{tmp}/missing.npy", "--out", "{tmp}/l.npy"],
     "--tokens {tmp}/missing.npy: no such file; expected a local .npy file"),
    (["sweep", "{tmp}/sweep.yaml", "--out", "gs://b/sweep"],
     "--out gs://b/sweep: a sweep writes its results to a local folder; expected a local path"),
    (["convert", "from-hf", "--hf-dir", "{tmp}/missing", "--out", "gs://b/run"],
     "--hf-dir {tmp}/missing: {tmp}/missing/config.json not found"),
    (["convert", "fold-norms", "--run-dir", "{tmp}/missing", "--out", "gs://b/folded"],
     "'{tmp}/missing' is not a run directory: it has no config.yaml"),
    (["ckpt", "inspect", "gs://b/run", "--step", "-1"],
     "argument --step: expected a checkpoint's step, an integer >= 0; got '-1'"),
    (["train", "--config", "configs/llama_tiny.yaml", "--set", "run_dir=gs://b/run", "--cpu-devices", "0"],
     "--cpu-devices must be >= 1, got 0"),
])
def test_local_refusals_come_before_any_bucket(tmp_path, capsys, no_bucket, command, message):
    """A bucket that cannot be reached costs a minute of retries and a page of traceback; what is wrong here is
    said first, in one line."""
    from scaletrain.__main__ import main

    (tmp_path / "a.txt").write_text("text")
    (tmp_path / "t.npy").write_bytes(b"")
    (tmp_path / "sweep.yaml").write_text(f"base: {ROOT / 'configs' / 'llama_tiny.yaml'}\nstages: [run]\n"
                                         f"variants: [{{steps: 1}}]\n")
    try:
        code = main([a.format(tmp=tmp_path) for a in command])
    except SystemExit as usage:  # argparse's own errors
        code = usage.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"error: {message.format(tmp=tmp_path)}") and err.count("\n") == 1, err
