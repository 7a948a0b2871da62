"""Two processes x 4 CPU devices (jax.distributed + gloo) train, checkpoint and resume as one 8-device job: every
step's loss and gradient norm, and the final parameters and Adam moments, within 1e-5 relative
(tests/equivalence.py).

Every two-process run costs two processes' start (about 10 s of CPU each, whatever their steps), so one run plays
several parts: the two-process run the other tests read resumes the one-process run's step-2 checkpoint (one
process's checkpoint read in two), and the preempted and killed run starts from the same checkpoint, so that its
losses are that run's, bitwise."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from scaletrain.tools import status
from tests import equivalence
from tests.conftest import ROOT, run_main, tiny_overrides

STEPS = 8


def _args(run_dir, **extra):
    sets = tiny_overrides(run_dir, **{"mesh.fsdp": -1, "steps": STEPS, "checkpoint.every_steps": 2, **extra})
    return ["--config", "configs/llama_tiny.yaml"] + [a for s in sets for a in ("--set", s)]


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "event" not in r]  # a straggler named is an event among the steps


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start_two(run_dir, faults=(None, None), **extra):
    """Both processes; faults[i] = (point, step) runs process i under tests/faults.py."""
    port = _free_port()
    procs = []
    for i, fault in enumerate(faults):
        entry = [str(ROOT / "train.py")] if fault is None else [str(ROOT / "tests" / "faults.py"), *map(str, fault)]
        procs.append(subprocess.Popen(
            [sys.executable, *entry, *_args(run_dir, **extra), "--cpu-devices", "4", "--coordinator",
             f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)],
            cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    return procs


def _run_two(run_dir, **extra):
    procs = _start_two(run_dir, **extra)
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    return [out for out, _ in outputs]


def _resumed_step(stdout):
    return int(re.search(r"resumed at step (\d+)", stdout).group(1))


# Where the two-process runs take over from the one-process run (its checkpoint at this step).
SEED = 2


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process of 8 devices: this one (conftest.run_main), sparing a process start. Every checkpoint kept: the
    two-process runs start from its step-SEED one (_seeded)."""
    run_dir = tmp_path_factory.mktemp("one")
    result = run_main(_args(run_dir, **{"checkpoint.max_to_keep": STEPS}) + ["--cpu-devices", "8"])
    assert result.returncode == 0, result.stderr
    return run_dir, equivalence.from_run_dir(run_dir)


def _seeded(run_dir, one_process):
    """`run_dir` as the one-process run left it after step SEED (its later checkpoints removed: a run resumes from
    its newest, and writes the steps after it again)."""
    shutil.copytree(one_process[0], run_dir, dirs_exist_ok=True)
    for step in range(SEED + 1, STEPS + 1):
        shutil.rmtree(run_dir / "checkpoints" / str(step), ignore_errors=True)
    return run_dir


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, one_process):
    """Two processes of 4 devices resuming the one-process run's step-2 checkpoint (one process's checkpoint read in
    two: they must read exactly the batches one process would have read next) for its steps 3-8, process 1's data
    source stalling 10 s as it makes step 6's batch (tests/faults.py: its 4th batch since the resume), watched with
    a 3 s threshold: (run directory, its run, each process's stderr). The stall changes no number;
    test_a_stalled_process_is_dumped_and_names_itself reads what the watchdog made of it."""
    run_dir = _seeded(tmp_path_factory.mktemp("two"), one_process)
    procs = _start_two(run_dir, faults=(None, ("stall", 5 - SEED)), **{"train.hang.seconds": 3,
                                                                        "train.hang.factor": 1})
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    stdout = [out for out, _ in outputs]
    assert "8 cpu devices" in stdout[0] and "scaletrain:" not in stdout[1]  # only process 0 reports
    assert _resumed_step(stdout[0]) == SEED
    assert len(_losses(run_dir)) == STEPS
    return run_dir, equivalence.from_run_dir(run_dir), [err for _, err in outputs]


def test_two_processes_equal_one(one_process, two_processes):
    """Steps 3-8 in two processes, from the one-process run's step-2 checkpoint, equal its own steps 3-8 (from scratch
    in two processes: the pipeline runs below). Gloo sums in another order than in-process collectives: equal to
    rounding, not bitwise."""
    equivalence.assert_same(two_processes[1], one_process[1])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pipeline_across_the_two_processes_equals_one(tmp_path, one_process, schedule):
    """Stage 0 on process 0's devices and stage 1 on process 1's (mesh.dcn_pipeline=2: each process plays a
    slice), FSDP over each one's 4: the activations (and under 1F1B their gradients, permuted by hand) cross
    between the processes, and the losses are one process's without stages."""
    # Saved once, at the end (what from_run_dir reads): the saves along the way are the other tests'.
    _run_two(tmp_path, **{"mesh.fsdp": 4, "mesh.dcn_pipeline": 2, "pipeline.microbatches": 2,
                          "pipeline.schedule": schedule, "checkpoint.every_steps": STEPS})
    equivalence.assert_same(equivalence.from_run_dir(tmp_path), one_process[1])


def test_two_process_checkpoint_resumes_in_one_and_back(tmp_path, one_process, two_processes, capfd):
    """Each process count reads exactly the batches the other would have read next: the two-process run resumed
    from one process's checkpoint (the two_processes fixture, compared by test_two_processes_equal_one), and its
    own step-6 checkpoint resumes in one process."""
    source, want = two_processes[:2]
    shutil.copytree(source, tmp_path / "in_one")
    shutil.rmtree(tmp_path / "in_one" / "checkpoints" / str(STEPS))  # as if stopped after the step-6 save
    assert _resumed_step(run_main(_args(tmp_path / "in_one") + ["--cpu-devices", "8"], capfd).stdout) == 6
    equivalence.assert_same(equivalence.from_run_dir(tmp_path / "in_one"), want)


def test_preempted_then_killed_two_process_run_resumes_bitwise(tmp_path, one_process, two_processes):
    """From the one-process step-2 checkpoint, as the two_processes run: its losses are then this run's, bitwise."""
    uninterrupted = _losses(two_processes[0])
    _seeded(tmp_path, one_process)
    # SIGTERM reaches process 1 only: both processes agree to save at the same step and exit 0. Time-based
    # saves (every ~30 ms by process 0's clock) must be agreed alike, or a save would hang.
    stdout = _run_two(tmp_path, faults=(None, ("sigterm", SEED + 2)), **{"checkpoint.every_minutes": 0.0005})
    preempted = int(re.search(r"preempted: checkpointed at step (\d+)", stdout[0]).group(1))
    assert SEED + 2 < preempted < STEPS - 1 and (tmp_path / "checkpoints" / str(preempted)).is_dir()

    # Process 1's host dies (SIGKILL); the scheduler then kills process 0 and restarts the job.
    procs = _start_two(tmp_path, faults=(None, ("between-steps", preempted + 2)))
    procs[1].communicate(timeout=300)
    assert procs[1].returncode == -signal.SIGKILL
    procs[0].kill()
    procs[0].communicate()

    stdout = _run_two(tmp_path)
    assert _resumed_step(stdout[0]) >= preempted
    assert _losses(tmp_path) == uninterrupted


def test_a_stalled_process_is_dumped_and_names_itself(two_processes):
    """Process 1's data source slept 10 s making step 6's batch. Past the 3 s threshold its watchdog dumped every
    thread's stack, its own sleeping frame among them, saying `data`; process 0, waiting in the step's collectives
    for it, says `step`. Neither exited (train.hang.exit is false): the run finished (docs/health.md). Process 1 is
    named the straggler."""
    tmp_path, _, stderr = two_processes
    stalled = tmp_path / "hangs" / "process-1-step-6-data.txt"
    assert "warning: process 1 on " in stderr[1] and "has been in data for step 6" in stderr[1]
    assert str(stalled) in stderr[1]
    dump = stalled.read_text()
    assert dump.startswith("process 1 on ") and "in put_batch_interrupted" in dump and 'File "' in dump
    # Process 0 waited for it in step 6 (a save slowed by the machine's load may have crossed 3 s too).
    others = [p.name for p in (tmp_path / "hangs").iterdir() if p.name.startswith("process-0-")]
    assert "process-0-step-6-step.txt" in others and not [name for name in others if name.endswith("-data.txt")]
    # Its 10 s batch, a tenth of its mean batch time over ten steps, put it far behind process 0: named a
    # straggler once, by process 0 and, with its host, by itself, and in metrics.jsonl.
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"event"' in line]
    assert [(e["event"], e["process"]) for e in events] == [("straggler", 1)]
    assert events[0]["batch_s"] > 0.9 and events[0]["median_batch_s"] < 0.5
    assert events[0]["batch_s"] - events[0]["median_batch_s"] > 0.25 * events[0]["step_time_s"]  # the default share
    assert "process 1 is the straggler" in stderr[0] and "this process (1 on " in stderr[1]
    health = status.status(str(tmp_path))["health"]
    assert [e["process"] for e in health["stragglers"]] == [1] and stalled.name in health["hangs"]


def test_distributed_flags_go_together(tmp_path, capfd):
    result = run_main(_args(tmp_path) + ["--coordinator", "localhost:1"], capfd)
    assert result.returncode == 2 and result.stderr.startswith("error: --coordinator HOST:PORT, --num-processes")


@pytest.mark.parametrize("address", ["localhost", "localhost:", "localhost:http", "localhost:70000", ":8476"])
def test_coordinator_needs_a_host_and_a_port(address, capsys):
    from scaletrain.__main__ import main

    args = ["train", *_args("unused"), "--coordinator", address, "--num-processes", "2", "--process-id", "0"]
    assert main(args) == 2
    assert capsys.readouterr().err == ("error: --coordinator expects HOST:PORT with a port in 1-65535 (e.g. "
                                       f"10.0.0.2:8476), got '{address}'\n")


def test_a_peer_that_never_starts_is_said_before_the_wait_and_ends_it_in_one_error_line():
    """Process 0 of 2 alone, with a 2 s timeout (the module constant, patched in the subprocess)."""
    address = f"localhost:{_free_port()}"
    script = ("import sys; from scaletrain import runtime; runtime.INITIALIZATION_TIMEOUT_S = 2; "
              "from scaletrain.__main__ import main; sys.exit(main(sys.argv[1:]))")
    result = subprocess.run(
        [sys.executable, "-c", script, "train", *_args("unused"), "--cpu-devices", "1", "--coordinator", address,
         "--num-processes", "2", "--process-id", "0"],
        cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=60)
    waiting = f"2 processes to join at {address} (process 0 of 2)"
    assert result.stdout == f"waiting for {waiting}; times out after 2 s\n"
    assert result.stderr == (f"error: timed out after 2 s waiting for {waiting}: check that every process has started, "
                             "with the same --coordinator and --num-processes\n")
    assert result.returncode == 2
