"""Goodput (scaletrain/train/goodput.py): a run's wall time by cause across the starts of its run directory - a
run SIGKILLed twice and resumed shows the steps it redid and its restarts as badput, and the causes add up to the
wall time; `status` reports such a run without touching it."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from scaletrain.tools import status
from scaletrain.train import goodput
from scaletrain.train.watchdog import Watchdog
from tests.conftest import ROOT, run_cli, run_main
from tests.test_resume import _command, _resumed_step, _run_with_fault, _wait_for_step


def _attempt(started, updated, first, last, productive, **badput):
    return {"started": started, "updated": updated, "first_step": first, "last_step": last, "productive": productive,
            "badput": {**dict.fromkeys(goodput.CAUSES, 0.0), **badput}, "redone_steps": 0, "ended": None}


def test_totals_move_redone_work_to_badput_and_add_up_to_the_wall_time():
    # 20 s: 2 starting, 10 stepping (steps 1-10), 8 unaccounted (idle). Killed; 5 s later a start that restores
    # step 6 redoes steps 7-10 (4 of the first attempt's 1 s steps) and runs 30 s: 3 compiling, 25 stepping.
    first = _attempt(100.0, 120.0, 0, 10, 10.0, startup=2.0)
    second = _attempt(125.0, 155.0, 6, 30, 25.0, compile=3.0, redone=4.0, restart=5.0)
    second["redone_steps"] = 4
    total = goodput.totals([first, second])
    assert total["wall"] == pytest.approx(55.0)  # 20 + 5 + 30
    assert total["productive"] == pytest.approx(10 + 25 - 4)
    assert total["badput"] == pytest.approx({**dict.fromkeys(goodput.CAUSES, 0.0), "startup": 2.0, "compile": 3.0,
                                             "redone": 4.0, "restart": 5.0, "idle": 8.0 + 2.0})
    assert total["productive"] + sum(total["badput"].values()) == pytest.approx(total["wall"])
    assert total["redone_steps"] == 4 and total["goodput"] == pytest.approx(31 / 55)
    assert goodput.describe(total).startswith("goodput 56.4% of 55 s (badput: idle 18.2%, restart 9.1%, ")


@pytest.mark.parametrize("ended", ["finished", "stopped", None])
def test_a_finished_run_started_again_loses_nothing_between(tmp_path, ended):
    """A later start that raises `steps` continues a finished run (or one stopped on a non-finite loss): the days
    between are no restart, and nothing is redone; after a killed one (ended null) they are a restart."""
    first = _attempt(time.time() - 86400.0, time.time() - 86390.0, 0, 10, 10.0)
    first["ended"] = ended
    (tmp_path / "goodput.json").write_text(json.dumps({"attempts": [first]}))
    ledger = goodput.Ledger(str(tmp_path), 0, time.perf_counter())
    ledger.resumed(8)
    restart, redone = ledger.attempt["badput"]["restart"], ledger.attempt["badput"]["redone"]
    if ended is None:
        assert restart > 86000 and redone == pytest.approx(2.0) and ledger.attempt["redone_steps"] == 2
    else:
        assert restart == redone == 0.0 and ledger.attempt["redone_steps"] == 0


@pytest.fixture(scope="module")
def killed_twice(tmp_path_factory):
    """A run of 18 steps SIGKILLed right after step 10's record and, resumed, after step 17's; then resumed to the
    end: (its run directory, the resumed steps of the second and third starts, the last start's output, the
    seconds it all took)."""
    run_dir, began = tmp_path_factory.mktemp("killed_twice"), time.time()
    # Saves at 4, 8, 12, 16 (each waits for the one before): a kill at 10 has step 4 committed at least.
    for step in (10, 17):
        killed = _run_with_fault("between-steps", step, run_dir)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
    result = run_cli(_command(run_dir))  # a process of its own: a module fixture cannot capture this one's output
    assert result.returncode == 0, result.stderr
    return run_dir, (_resumed_step(killed), _resumed_step(result)), result.stdout, time.time() - began


def test_two_kills_show_as_redone_steps_and_restarts(killed_twice):
    run_dir, (second_start, third_start), _, elapsed = killed_twice
    attempts = goodput.read(run_dir)
    assert [a["ended"] for a in attempts] == [None, None, "finished"]
    # Each kill came right after step 10's (17's) record: what the next start restored before it is redone.
    assert [a["redone_steps"] for a in attempts] == [0, 10 - second_start, 17 - third_start]
    # Redone time: the steps redone that the attempt before had recorded in its ledger, at its own pace - never
    # more than it spent stepping. Those it finished after its last record (a record is written every 2 s) are
    # counted in redone_steps, their time in the restart: from its last record to the next start.
    for before, after in itertools.pairwise(attempts):
        recorded = max(0, before["last_step"] - after["first_step"])
        pace = before["productive"] / (before["last_step"] - before["first_step"])
        assert after["badput"]["redone"] == pytest.approx(recorded * pace)
        assert after["badput"]["redone"] <= before["productive"]
        assert 0 < after["badput"]["restart"] == pytest.approx(after["started"] - before["updated"])
    total = goodput.totals(attempts)
    assert total["redone_steps"] == sum(a["redone_steps"] for a in attempts) > 0
    accounted = total["productive"] + sum(total["badput"].values())
    assert abs(accounted - total["wall"]) <= 0.05 * total["wall"]
    assert 0 < total["wall"] <= elapsed and 0 < total["goodput"] < 1


def test_status_reports_a_finished_run_without_touching_it(killed_twice, tmp_path, capfd):
    run_dir, _, _, _ = killed_twice
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    plot = tmp_path / "curves.png"
    result = run_main(["status", str(run_dir), "--json", "--plot", str(plot)], capfd, module=True)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before
    assert (report["state"], report["step"], report["steps"], report["eta_s"]) == ("finished", 18, 18, 0.0)
    assert report["newest_checkpoint"] == 18 and report["lock"] is None
    assert report["tokens"] == 18 * 8 * 32  # global batch 8 x 32 tokens (the tiny overrides)
    assert report["goodput"] == goodput.totals(goodput.read(run_dir))
    assert [s for s, _ in report["losses"]] == list(range(1, 19))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = run_main(["status", str(run_dir), "--plot", str(plot)], capfd, module=True).stdout
    assert f"{run_dir}: finished, step 18 of 18" in text
    assert f"3 start(s), {report['goodput']['redone_steps']} steps redone" in text
    assert status.sparkline([1.0, 8.0, 2.0]) == "▁█▂" and len(status.sparkline(list(range(100)))) == 40


def test_status_of_a_directory_that_is_no_run_is_an_error(tmp_path, capfd):
    result = run_main(["status", str(tmp_path)], capfd, module=True)
    assert result.returncode == 2 and "is not a run directory (no config.yaml)" in result.stderr


def test_status_of_a_live_run_names_its_holder_and_an_eta(tmp_path, capfd):
    # 18 steps, the batch of step 6 taking 10 s to make (tests/faults.py): status while the run waits for it.
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "faults.py"), "stall", "5", *_command(tmp_path)],
                            cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(proc, tmp_path, 5)
        result = run_main(["status", str(tmp_path), "--json", "--plot", str(tmp_path / "curves.png")], capfd,
                          module=True)
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
    finally:
        proc.kill()
        proc.communicate()
    assert report["state"] == "running" and report["lock"]["pid"] == proc.pid and report["lock"]["alive"]
    assert 5 <= report["step"] < 18 and report["eta_s"] > 0
    assert report["newest_checkpoint"] >= 4


def test_status_reads_a_bucket_run_directory(bucket, capfd):
    run_dir = f"{bucket}/status"
    trained = run_main(_command(run_dir, steps=4))
    assert trained.returncode == 0, trained.stderr
    result = run_main(["status", run_dir, "--json", "--plot", os.devnull], capfd, module=True)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["state"], report["step"], report["newest_checkpoint"]) == ("finished", 4, 4)
    assert report["goodput"]["attempts"] == 1 and report["run_dir"] == run_dir


def test_the_watchdog_waits_for_the_larger_of_its_floor_and_its_factor_of_the_median_step(tmp_path):
    dog = Watchdog(str(tmp_path), 0, factor=10.0, seconds=2.0, exit_on_hang=False)
    try:
        assert dog.threshold() == 2.0  # no step yet
        for seconds in (0.1, 0.5, 0.3):
            dog.step_time(seconds)
        assert dog.threshold() == pytest.approx(3.0)  # 10 x the median 0.3
    finally:
        dog.close()
