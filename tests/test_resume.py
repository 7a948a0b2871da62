"""Kill a training run (SIGKILL, SIGTERM), rerun the same command: every step's loss is bitwise identical."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, run_cli, tiny_overrides

STEPS = 30


def _command(run_dir):
    sets = tiny_overrides(run_dir, **{"mesh.fsdp": -1, "steps": STEPS, "checkpoint.every_steps": 4})
    return ["--config", "configs/llama_tiny.yaml", "--cpu-devices", "8"] + [a for s in sets for a in ("--set", s)]


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    for r in records:
        assert {"step", "loss", "grad_norm", "learning_rate", "tokens_per_sec", "step_time_s", "mfu"} <= set(r)
    return [r["loss"] for r in records]


def _start(run_dir):
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *_command(run_dir)], cwd=ROOT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finished_checkpoints(run_dir):
    ckpts = run_dir / "checkpoints"
    return [int(p.name) for p in ckpts.iterdir() if p.name.isdigit()] if ckpts.exists() else []


def _wait_for_step(proc, run_dir, step, timeout=240):
    """Until `step` is logged and some checkpoint is complete, so that the rerun really resumes."""
    deadline = time.time() + timeout
    path = run_dir / "metrics.jsonl"
    while time.time() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= step and _finished_checkpoints(run_dir):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout} s")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    result = run_cli(_command(run_dir))
    assert result.returncode == 0, result.stderr
    assert (run_dir / "config.yaml").exists() and (run_dir / "tb").is_dir()
    losses = _losses(run_dir)
    assert len(losses) == STEPS and losses[-1] < losses[0]
    return run_dir, losses


def test_sigkill_then_rerun_is_bitwise_identical(tmp_path, uninterrupted):
    _, uninterrupted = uninterrupted
    proc = _start(tmp_path)
    _wait_for_step(proc, tmp_path, 7)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    result = run_cli(_command(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "resumed at step" in result.stdout
    assert _losses(tmp_path) == uninterrupted


def test_sigterm_saves_exits_0_and_resumes_at_the_next_step(tmp_path, uninterrupted):
    _, uninterrupted = uninterrupted
    proc = _start(tmp_path)
    _wait_for_step(proc, tmp_path, 5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    saved = max(_finished_checkpoints(tmp_path))
    assert saved < STEPS and f"preempted: checkpointed at step {saved}" in out
    result = run_cli(_command(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"resumed at step {saved}" in result.stdout
    assert _losses(tmp_path) == uninterrupted


def test_unreadable_newest_checkpoint_is_skipped_and_rewritten(tmp_path, uninterrupted):
    _, uninterrupted = uninterrupted
    result = run_cli(_command(tmp_path))
    assert result.returncode == 0, result.stderr
    assert sorted(_finished_checkpoints(tmp_path)) == [24, 28, STEPS]
    for f in (tmp_path / "checkpoints" / str(STEPS)).rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    result = run_cli(_command(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"warning: checkpoint at step {STEPS} is unreadable" in result.stderr
    assert "resumed at step 28" in result.stdout
    assert _losses(tmp_path) == uninterrupted  # and the final step was saved again over the unreadable one


def test_checkpoints_describe_themselves(uninterrupted):
    run_dir, _ = uninterrupted
    result = run_cli(["ckpt", "inspect", str(run_dir), "--json"], module=True)
    assert result.returncode == 0, result.stderr
    meta = json.loads(result.stdout)
    assert meta["step"] == STEPS and meta["config"]["steps"] == STEPS and len(meta["config_hash"]) == 16
    assert meta["mesh"] == {"axes": {"data": 1, "fsdp": 8, "expert": 1, "pipeline": 1, "tensor": 1},
                            "devices": 8, "processes": 1}
    w_gate = meta["arrays"][".params['layers']['mlp']['w_gate']"]
    assert w_gate == {"shape": [2, 64, 128], "dtype": "float32", "logical": ["layers", "embed", "mlp"]}
    moments = [a for p, a in meta["arrays"].items() if p.startswith(".opt_state") and a["shape"] == [2, 64, 128]]
    assert len(moments) == 4 and all(a["logical"] == ["layers", "embed", "mlp"] for a in moments)  # mu, nu of gate, up
    result = run_cli(["ckpt", "inspect", str(run_dir), "--step", "28"], module=True)
    assert result.returncode == 0 and result.stdout.startswith("step 28  scaletrain 0.1.0")
    result = run_cli(["ckpt", "inspect", str(run_dir), "--step", "5"], module=True)
    assert result.returncode == 2 and result.stderr.startswith("error: no checkpoint at step 5")


def test_nonfinite_loss_stops_or_skips_as_configured(tmp_path):
    def command(mode):
        sets = tiny_overrides(tmp_path / mode, **{"mesh.fsdp": -1, "steps": 6, "checkpoint.every_steps": 1,
                                                  "optim.learning_rate": 1e30, "optim.grad_clip_norm": 0,
                                                  "train.on_nonfinite": mode})
        return ["--config", "configs/llama_tiny.yaml", "--cpu-devices", "8"] + [a for s in sets for a in ("--set", s)]

    stop = run_cli(command("stop"))
    assert stop.returncode == 1, stop.stderr
    error = [line for line in stop.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "non-finite loss or gradient norm" in error[0]
    skipped = [json.loads(line) for line in (tmp_path / "stop" / "metrics.jsonl").read_text().splitlines()]
    assert skipped[-1]["update_skipped"] == 1.0 or skipped[-2]["update_skipped"] == 1.0
    assert len(skipped) < 6

    skip = run_cli(command("skip"))
    assert skip.returncode == 0, skip.stderr
    records = [json.loads(line) for line in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 6 and any(r["update_skipped"] for r in records)
    assert "update dropped" in skip.stderr
