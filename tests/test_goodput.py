"""Goodput (scaletrain/train/goodput.py): a run's wall time by cause across the starts of its run directory - a
run SIGKILLed twice and resumed shows the steps it redid and its restarts as badput, and the causes add up to the
wall time."""

import signal
import time

import pytest

from scaletrain.train import goodput
from tests.conftest import run_main
from tests.test_resume import _command, _resumed_step, _run_with_fault


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


def test_a_finished_run_started_again_loses_nothing_between():
    """A later start that raises `steps` continues a finished run: the days between are no restart."""
    first = _attempt(0.0, 10.0, 0, 10, 10.0)
    first["ended"] = "finished"
    total = goodput.totals([first, _attempt(86400.0, 86410.0, 10, 20, 10.0)])
    assert total["wall"] == pytest.approx(20.0) and total["badput"]["restart"] == 0.0


def test_two_kills_show_as_redone_steps_and_restarts(tmp_path, capfd):
    began = time.time()
    # Saves at 4, 8, 12, 16 (each waits for the one before): a kill at 10 has step 4 committed at least.
    for step in (10, 17):
        killed = _run_with_fault("between-steps", step, tmp_path)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
    second_start = _resumed_step(killed)
    result = run_main(_command(tmp_path), capfd)
    assert result.returncode == 0, result.stderr
    elapsed = time.time() - began

    attempts = goodput.read(tmp_path)
    assert [a["ended"] for a in attempts] == [None, None, "finished"]
    # Each kill came right after step 10's (17's) record: what the next start restored before it is redone.
    assert [a["redone_steps"] for a in attempts] == [0, 10 - second_start, 17 - _resumed_step(result)]
    assert all(a["badput"]["restart"] > 0 and a["badput"]["redone"] > 0 for a in attempts[1:])
    total = goodput.totals(attempts)
    assert total["redone_steps"] == sum(a["redone_steps"] for a in attempts) > 0
    accounted = total["productive"] + sum(total["badput"].values())
    assert abs(accounted - total["wall"]) <= 0.05 * total["wall"]
    assert 0 < total["wall"] <= elapsed and 0 < total["goodput"] < 1
    assert f"; goodput {total['goodput']:.1%}" in result.stdout
