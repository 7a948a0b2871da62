"""Kill a training run (SIGKILL, SIGTERM), rerun the same command: every step's loss is bitwise identical.

The runs killed, and those beside another, are processes of their own; the others - the uninterrupted run, each
rerun, every refusal and `ckpt inspect` - run the same command in the test's process (conftest.run_main), which
spares each a process start and JAX's import (about 4 s)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from etils import epath

from tests.conftest import ROOT, run_main, tiny_overrides

STEPS = 18  # saves at 4, 8, 12, 16 and the last step: a kill at 8, 11 or 14 lands among them
EVERY = 4


def _command(run_dir, **extra):
    sets = tiny_overrides(run_dir, **{"mesh.fsdp": -1, "steps": STEPS, "checkpoint.every_steps": EVERY, **extra})
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


def _run_with_fault(point, step, run_dir):
    """train.py interrupted from inside at an exact moment (tests/faults.py)."""
    return subprocess.run([sys.executable, str(ROOT / "tests" / "faults.py"), point, str(step), *_command(run_dir)],
                          cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                          timeout=300)


def _finished_checkpoints(run_dir):
    ckpts = run_dir / "checkpoints"
    return [int(p.name) for p in ckpts.iterdir() if p.name.isdigit() and (p / "commit_success.txt").exists()] \
        if ckpts.exists() else []


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
    result = run_main(_command(run_dir))
    assert result.returncode == 0, result.stderr
    assert (run_dir / "config.yaml").exists() and (run_dir / "tb").is_dir()
    losses = _losses(run_dir)
    assert len(losses) == STEPS and losses[-1] < losses[0]
    return run_dir, losses


def _resumed_step(result):
    match = re.search(r"resumed at step (\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    return int(match.group(1))


# Killed at each moment in turn, in one run directory: a save half written (step 8), a step running (step 11),
# between steps (step 14). Each rerun resumes from the newest committed step and is the next one killed; the last
# runs to the end.
KILLS = [("mid-save", 8), ("mid-step", 11), ("between-steps", 14)]


def test_sigkill_at_any_moment_then_rerun_is_bitwise_identical(tmp_path, uninterrupted, capfd):
    _, uninterrupted = uninterrupted
    resumed = 0
    for point, step in KILLS:
        # mid-step counts the batches this process makes (tests/faults.py): after a resume at R, its k-th is step
        # R + k's. The other points name the step itself.
        killed = _run_with_fault(point, step - resumed if point == "mid-step" else step, tmp_path)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        if resumed:
            assert _resumed_step(killed) == resumed
        if point != "mid-save":  # (the save runs in the background: the steps after it go on)
            last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"]
            assert last == step if point == "between-steps" else last in (step - 1, step), (point, last)
        committed = max(_finished_checkpoints(tmp_path))
        if point == "mid-save":  # the half-written step is on disk, uncommitted; the older one is untouched
            assert (tmp_path / "checkpoints" / f"{step}.orbax-checkpoint-tmp").is_dir()
            assert committed == step - EVERY
        # Nothing committed is lost. A save waits for the previous one, so the newest durable save is at most two
        # save intervals old: that many steps at most are redone.
        assert committed >= step - 2 * EVERY
        resumed = committed
    result = run_main(_command(tmp_path), capfd)
    assert result.returncode == 0, result.stderr
    assert _resumed_step(result) == resumed
    assert _losses(tmp_path) == uninterrupted
    assert not list((tmp_path / "checkpoints").glob("*tmp*"))  # the killed saves' leftovers are gone


def _refused_beside(proc, run_dir, capfd) -> None:
    """Once `proc` (train.py on `run_dir`) holds run.lock, the same command beside it exits 2 with one line naming
    it, having touched nothing (the caller then checks `proc`'s output)."""
    while not (epath.Path(run_dir) / "run.lock").exists():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    second = run_main(_command(run_dir), capfd)
    assert second.returncode == 2
    [line] = [x for x in second.stderr.splitlines() if x.strip()]
    assert line.startswith(f"error: run_dir '{run_dir}' is in use by process {proc.pid} on ")


def test_sigkill_mid_save_in_a_bucket_then_rerun_is_bitwise_identical(bucket, uninterrupted, capfd):
    """In a bucket a step is written in its final folder (no rename): the killed save leaves step 8 there without
    its commit markers, and the rerun must resume from step 4, not read it. While the killed run held the bucket's
    lock, a second run of the same command was refused, and nothing the first wrote was lost (two runs on one run
    directory in a bucket: the local one is test_sigterm_saves_exits_0_and_resumes_at_the_next_step's)."""
    _, uninterrupted = uninterrupted
    run_dir = epath.Path(f"{bucket}/mid-save")
    first = subprocess.Popen([sys.executable, str(ROOT / "tests" / "faults.py"), "mid-save", "8",
                              *_command(run_dir)], cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _refused_beside(first, run_dir, capfd)
    _, err = first.communicate(timeout=300)
    assert first.returncode == -signal.SIGKILL, err
    assert (run_dir / "checkpoints" / "8").exists() and max(_finished_checkpoints(run_dir)) == 4
    # The bucket's metrics.jsonl, synced at each save: the killed run's steps to its step-4 save at least.
    assert 4 <= len(_losses(run_dir)) and _losses(run_dir) == uninterrupted[:len(_losses(run_dir))]
    result = run_main(_command(run_dir), capfd)
    assert result.returncode == 0, result.stderr
    assert _resumed_step(result) == 4
    assert _losses(run_dir) == uninterrupted
    assert not (run_dir / "run.lock").exists()


def test_sigterm_saves_exits_0_and_resumes_at_the_next_step(tmp_path, uninterrupted, capfd):
    """While the run holds its directory's lock, a second run of the same command is refused, and nothing the first
    writes is lost (two runs on one run directory, locally: the bucket's is
    test_sigkill_mid_save_in_a_bucket_then_rerun_is_bitwise_identical's)."""
    _, uninterrupted = uninterrupted
    proc = _start(tmp_path)
    _refused_beside(proc, tmp_path, capfd)
    _wait_for_step(proc, tmp_path, 5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    saved = max(_finished_checkpoints(tmp_path))
    assert saved < STEPS and f"preempted: checkpointed at step {saved}" in out
    ran = _losses(tmp_path)
    assert len(ran) >= saved and ran == uninterrupted[:len(ran)]  # every step it ran, as the uninterrupted run's
    assert not (tmp_path / "run.lock").exists()  # removed on the way out
    result = run_main(_command(tmp_path), capfd)
    assert result.returncode == 0, result.stderr
    assert f"resumed at step {saved}" in result.stdout
    assert _losses(tmp_path) == uninterrupted


def test_sigterm_before_the_first_step_exits_0(tmp_path):
    result = _run_with_fault("sigterm-early", 0, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "preempted before step 1" in result.stdout and not (tmp_path / "metrics.jsonl").exists()


def _garble(step_dir):
    for f in step_dir.rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")


def _truncate(step_dir):
    for f in (step_dir / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":  # the array data files
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garble_in_place(step_dir):
    """2,000 bytes of the largest array file overwritten, its size unchanged: Orbax reads it without complaint."""
    largest = max((f for f in (step_dir / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data = bytearray(largest.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 2000] = bytes(range(256)) * 7 + bytes(208)
    largest.write_bytes(bytes(data))


def _uncommit(step_dir):
    (step_dir / "commit_success.txt").unlink()


# Bytes garbled in place are caught by Tensorstore (unreadable) or, where it reads them without complaint, by the
# fingerprints (damaged): which, depends on the file that happens to be largest.
@pytest.mark.parametrize("damage, problem", [(_garble, "unreadable"), (_truncate, "unreadable"),
                                             (_garble_in_place, "(unreadable|damaged)"), (_uncommit, "incomplete")])
def test_damaged_newest_checkpoint_is_skipped_and_rewritten(tmp_path, uninterrupted, damage, problem, capfd):
    done, uninterrupted = uninterrupted
    shutil.copytree(done, tmp_path, dirs_exist_ok=True)
    assert sorted(_finished_checkpoints(tmp_path)) == [STEPS - 6, STEPS - 2, STEPS]
    damage(tmp_path / "checkpoints" / str(STEPS))
    result = run_main(_command(tmp_path, **{"checkpoint.max_to_keep": 1}), capfd)
    assert result.returncode == 0, result.stderr
    # XLA's C++ logging may share stderr's lines: the warning is looked for anywhere in them.
    warnings = re.findall(r"warning: checkpoint at step \d+ is \w+", result.stderr)
    assert len(warnings) == 1 and re.fullmatch(f"warning: checkpoint at step {STEPS} is {problem}", warnings[0])
    assert _resumed_step(result) == STEPS - 2
    assert _losses(tmp_path) == uninterrupted  # and the final step was saved again
    assert run_main(["ckpt", "inspect", str(tmp_path)], capfd, module=True).stdout.startswith(f"step {STEPS} ")
    # With max_to_keep=1, the step resumed from is kept all the same, and a damaged step is set aside, not deleted.
    assert sorted(_finished_checkpoints(tmp_path)) == [STEPS - 2, STEPS]
    assert (tmp_path / "damaged_checkpoints" / str(STEPS)).is_dir() == (problem != "incomplete")


def test_no_usable_checkpoint_is_an_error_and_deletes_nothing(tmp_path, uninterrupted, capfd):
    done, _ = uninterrupted
    shutil.copytree(done, tmp_path, dirs_exist_ok=True)
    for step in (STEPS - 6, STEPS - 2):
        _truncate(tmp_path / "checkpoints" / str(step))
    _uncommit(tmp_path / "checkpoints" / str(STEPS))
    result = run_main(_command(tmp_path), capfd)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no readable checkpoint" in errors[0] and "Traceback" not in result.stderr
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == sorted(map(str, [STEPS - 6, STEPS - 2, STEPS]))


def _contents(directory):
    return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@pytest.mark.parametrize("change, message", [
    # Not advised checkpoint.init_from, whose parameters of other shapes cannot start this model either.
    ({"model.d_model": 32}, "error: run_dir '{}' holds checkpoints (step {}) of another model: model.d_model is 64 "
                            "there, 32 here. Nothing was changed. To train this model, give it another run_dir; its "
                            "parameters' shapes differ from this model's, so they cannot start it either"),
    ({"data.seq_len": 16384}, "error: the train step does not fit: 8 CPU devices need "),
])
def test_a_run_that_cannot_proceed_changes_nothing(tmp_path, uninterrupted, change, message, capfd):
    done, _ = uninterrupted
    shutil.copytree(done, tmp_path, dirs_exist_ok=True)
    before = _contents(tmp_path)
    result = run_main(_command(tmp_path, **change), capfd)
    assert result.returncode == 2
    [line] = [x for x in result.stderr.splitlines() if x.strip()]
    assert line.startswith(message.format(tmp_path, STEPS))
    assert _contents(tmp_path) == before


def test_another_model_of_the_same_shapes_is_advised_init_from_with_another_run_dir(tmp_path, uninterrupted, capfd):
    """Parameters of this model's shapes (another dtype) can start it - from another run_dir: checkpoint.init_from
    starts only a run_dir without checkpoints, and this one, given init_from, refuses it the same."""
    done, _ = uninterrupted
    old = tmp_path / "old"
    shutil.copytree(done, old)
    before = _contents(old)
    change = {"model.param_dtype": "bfloat16"}
    message = (f"error: run_dir '{old}' holds checkpoints (step {STEPS}) of another model: model.param_dtype is "
               f"float32 there, bfloat16 here. Nothing was changed. To train this model, give it another run_dir, and "
               f"add checkpoint.init_from={old} to start it from those parameters (init_from starts only a run_dir "
               f"that holds no checkpoints)")
    for init in ({}, {"checkpoint.init_from": str(old)}):
        result = run_main(_command(old, **change, **init), capfd)
        assert result.returncode == 2
        assert [x for x in result.stderr.splitlines() if x.strip()] == [message]
        assert _contents(old) == before
    result = run_main(_command(tmp_path / "new", steps=1, **change, **{"checkpoint.init_from": str(old)}), capfd)
    assert result.returncode == 0, result.stderr
    assert f"starting at step 0 from the parameters of {old} (step {STEPS})" in result.stdout


def test_a_checkpoints_path_that_is_a_file_is_refused_before_compiling(tmp_path, capfd):
    (tmp_path / "checkpoints").write_text("not a folder")
    result = run_main(_command(tmp_path), capfd)
    assert result.returncode == 2 and "compiled" not in result.stdout
    [line] = [x for x in result.stderr.splitlines() if x.strip()]
    assert line == f"error: '{tmp_path / 'checkpoints'}' is a file; expected the run's checkpoints folder (or nothing)"


def test_init_from_takes_the_parameters_of_another_run(tmp_path, uninterrupted, capfd):
    done, losses = uninterrupted
    mesh = {"mesh.fsdp": 4, "mesh.data": 2, "steps": 2}
    source = done / "checkpoints" / str(STEPS - 2)
    result = run_main(_command(tmp_path / "new", **mesh, **{"checkpoint.init_from": str(source)}), capfd)
    assert result.returncode == 0, result.stderr
    assert f"starting at step 0 from the parameters of {source} (step {STEPS - 2})" in result.stdout
    assert _losses(tmp_path / "new")[0] < losses[0] - 1  # the same first batch, trained parameters
    other = run_main(_command(tmp_path / "other", **mesh, **{"checkpoint.init_from": str(done), "model.d_ff": 256}),
                     capfd)
    assert other.returncode == 2
    assert other.stderr.startswith("error: checkpoint.init_from: parameter ['layers']['mlp']")  # before compiling


def test_checkpoints_describe_themselves(uninterrupted, capfd):
    run_dir, _ = uninterrupted
    result = run_main(["ckpt", "inspect", str(run_dir), "--json"], capfd, module=True)
    assert result.returncode == 0, result.stderr
    meta = json.loads(result.stdout)
    assert meta["step"] == STEPS and meta["config"]["steps"] == STEPS and len(meta["config_hash"]) == 16
    assert meta["mesh"] == {"axes": {"data": 1, "fsdp": 8, "expert": 1, "pipeline": 1, "context": 1, "tensor": 1},
                            "devices": 8, "processes": 1}
    w_gate = meta["arrays"][".params['layers']['mlp']['w_gate']"]
    assert w_gate == {"shape": [2, 64, 128], "dtype": "float32", "logical": ["layers", "embed", "mlp"]}
    moments = [a for p, a in meta["arrays"].items() if p.startswith(".opt_state") and a["shape"] == [2, 64, 128]]
    assert len(moments) == 4 and all(a["logical"] == ["layers", "embed", "mlp"] for a in moments)  # mu, nu of gate, up
    result = run_main(["ckpt", "inspect", str(run_dir), "--step", str(STEPS - 2)], capfd, module=True)
    assert result.returncode == 0 and result.stdout.startswith(f"step {STEPS - 2}  scaletrain 0.1.0")
    result = run_main(["ckpt", "inspect", str(run_dir), "--step", "5"], capfd, module=True)
    assert result.returncode == 2 and result.stderr.startswith("error: no checkpoint at step 5")


def test_nonfinite_loss_stops_or_skips_as_configured(tmp_path, capfd):
    def command(mode):
        sets = tiny_overrides(tmp_path / mode, **{"mesh.fsdp": -1, "steps": 6, "checkpoint.every_steps": 1,
                                                  "optim.learning_rate": 1e30, "optim.grad_clip_norm": 0,
                                                  "train.on_nonfinite": mode})
        return ["--config", "configs/llama_tiny.yaml", "--cpu-devices", "8"] + [a for s in sets for a in ("--set", s)]

    stop = run_main(command("stop"), capfd)
    assert stop.returncode == 1, stop.stderr
    error = [line for line in stop.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "non-finite loss or gradient norm" in error[0]
    skipped = [json.loads(line) for line in (tmp_path / "stop" / "metrics.jsonl").read_text().splitlines()]
    assert skipped[-1]["update_skipped"] == 1.0 or skipped[-2]["update_skipped"] == 1.0
    assert len(skipped) < 6

    skip = run_main(command("skip"), capfd)
    assert skip.returncode == 0, skip.stderr
    records = [json.loads(line) for line in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 6 and any(r["update_skipped"] for r in records)
    assert "update dropped" in skip.stderr


def test_time_based_saves_each_sync_the_metrics_of_their_step(tmp_path, monkeypatch, capfd):
    """checkpoint.every_minutes saves by the clock (30 ms here: every step or two). A run directory in a bucket gets
    metrics.jsonl when a checkpoint is saved (and once a minute): the saved step's own record must be in it, or a
    run killed before the next sync resumes from that step without it. (Saves written before the step goes on,
    so that each sync's newest record is its save's step.)"""
    from scaletrain.store import storage
    from scaletrain.train import metrics

    synced = []

    def sync(mirror):
        synced.append([json.loads(line)["step"] for line in (mirror.local / "metrics.jsonl").read_text().splitlines()])

    monkeypatch.setattr(storage.Mirror, "sync", sync)
    monkeypatch.setattr(metrics, "SYNC_EVERY_S", float("inf"))
    result = run_main(_command(tmp_path, **{"steps": 12, "checkpoint.every_steps": 1000, "checkpoint.max_to_keep": 100,
                                           "checkpoint.every_minutes": 0.0005, "checkpoint.async_save": False}),
                      capfd)
    assert result.returncode == 0, result.stderr
    saved = sorted(_finished_checkpoints(tmp_path))
    assert saved[-1] == 12 and len(saved) >= 3, saved
    assert [steps[-1] for steps in synced[:len(saved)]] == saved, synced
