"""Two processes x 4 CPU devices (jax.distributed + gloo) train as one 8-device job."""

import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT, run_cli, tiny_overrides

STEPS = 6


def _args(run_dir):
    sets = tiny_overrides(run_dir, **{"mesh.fsdp": -1, "steps": STEPS, "checkpoint.every_steps": 2})
    return ["--config", "configs/llama_tiny.yaml"] + [a for s in sets for a in ("--set", s)]


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one")
    result = run_cli(_args(run_dir) + ["--cpu-devices", "8"])
    assert result.returncode == 0, result.stderr
    return _losses(run_dir)


def test_two_processes_equal_one_and_resume_in_one(tmp_path, one_process):
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *_args(tmp_path), "--cpu-devices", "4",
         "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)],
        cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for i in (0, 1)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert "8 cpu devices" in outputs[0][0] and "scaletrain:" not in outputs[1][0]  # only process 0 reports
    two = _losses(tmp_path)
    # Gloo sums in another order than in-process collectives: equal to rounding, not bitwise.
    np.testing.assert_allclose(two, one_process, rtol=1e-5)

    # As if preempted after the step-4 save: the 2-process checkpoint resumes in one process.
    shutil.rmtree(tmp_path / "checkpoints" / str(STEPS))
    result = run_cli(_args(tmp_path) + ["--cpu-devices", "8"])
    assert result.returncode == 0, result.stderr
    assert "resumed at step 4" in result.stdout
    np.testing.assert_allclose(_losses(tmp_path), one_process, rtol=1e-5)


def test_distributed_flags_go_together(tmp_path):
    result = run_cli(_args(tmp_path) + ["--coordinator", "localhost:1"])
    assert result.returncode == 2 and result.stderr.startswith("error: --coordinator HOST:PORT, --num-processes")
