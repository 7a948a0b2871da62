"""Every command-line verb against damaged run directories and bad arguments: `status` reports what it can read,
with a `warning:` line for each damaged file and exit status 0; every other verb exits 2 with one `error:` line.
Never a traceback (issue 54: a new user's 202 odd inputs, 18 of them tracebacks)."""

import json
import os
import time

import pytest

from scaletrain import config
from tests.conftest import ROOT, run_cli, run_main

STEPS = 20


def _healthy(run_dir):
    """A run directory as a stopped run leaves it: its config, 6 step records and a spike event, one attempt."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = config.load(ROOT / "configs/llama_tiny.yaml", [f"steps={STEPS}", f"run_dir={run_dir}"])
    (run_dir / "config.yaml").write_text(config.to_yaml(cfg))
    lines = [{"step": s, "loss": 5.0 - s / 10, "step_time_s": 0.5} for s in range(1, 7)]
    lines.insert(3, {"event": "loss_spike_skip", "step": 3, "loss": 9.0, "median": 4.7})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    now = time.time()
    attempt = {"started": now - 60, "updated": now - 30, "first_step": 0, "last_step": 6, "productive": 20.0,
               "badput": {"startup": 5.0}, "redone_steps": 0, "ended": None}
    (run_dir / "goodput.json").write_text(json.dumps({"attempts": [attempt]}))
    return run_dir


def _write(name, text):
    return lambda d: (d / name).write_text(text)


def _folder_for(name):
    def damage(d):
        (d / name).unlink(missing_ok=True)
        (d / name).mkdir()
    return damage


# (damage, what the warning names, what the report still says)
DAMAGES = {
    "goodput garbled": (_write("goodput.json", "{not json"), "goodput.json", "step 6 of 20"),
    "goodput a list": (_write("goodput.json", "[1, 2]"), "goodput.json", "step 6 of 20"),
    "goodput wrong types": (_write("goodput.json", '{"attempts": [{"started": "noon", "updated": 3}]}'),
                            "goodput.json", "step 6 of 20"),
    "goodput attempts not objects": (_write("goodput.json", '{"attempts": [1]}'), "goodput.json", "step 6 of 20"),
    "config empty": (_write("config.yaml", ""), "config.yaml", "step 6"),
    "config not yaml": (_write("config.yaml", "steps: [1\n  : :"), "config.yaml", "step 6"),
    "config a list": (_write("config.yaml", "- 1\n- 2\n"), "config.yaml", "step 6"),
    "config without steps": (_write("config.yaml", "train: {global_batch: 8}\n"), "config.yaml", "step 6"),
    "config a folder": (_folder_for("config.yaml"), "config.yaml", "step 6"),
    "metrics line not an object": (lambda d: open(d / "metrics.jsonl", "a").write("[1, 2]\n3\n\"x\"\n"),
                                   "metrics.jsonl: 3 line(s)", "step 6 of 20"),
    "metrics line without a step": (lambda d: open(d / "metrics.jsonl", "a").write('{"loss": 1.0}\n{"step": "7"}\n'),
                                    "metrics.jsonl: 2 line(s)", "step 6 of 20"),
    "metrics garbled mid-file": (lambda d: (d / "metrics.jsonl").write_text(
        "{cut\n" + (d / "metrics.jsonl").read_text()), "metrics.jsonl: 1 line(s)", "step 6 of 20"),
    "metrics empty": (_write("metrics.jsonl", ""), "metrics.jsonl holds no step records", "step 6 of 20"),
    "metrics a folder": (_folder_for("metrics.jsonl"), "metrics.jsonl cannot be read", "step 6 of 20"),
    "spike event without figures": (lambda d: open(d / "metrics.jsonl", "a").write('{"event": "loss_spike_skip"}\n'),
                                    "event(s) lack their figures", "step 6 of 20"),
    "run.lock a list": (_write("run.lock", "[1, 2]"), "run.lock holds no lock record", "step 6 of 20"),
    "run.lock wrong types": (_write("run.lock", '{"pid": "x", "host": 3}'), None, "step 6 of 20"),
    "hangs a file": (_write("hangs", "not a folder"), "hangs is not a folder", "step 6 of 20"),
    "checkpoints a file": (_write("checkpoints", "not a folder"), None, "newest checkpoint: none"),
}


@pytest.mark.parametrize("case", DAMAGES)
def test_status_of_a_damaged_run_warns_and_reports_the_rest(tmp_path, capfd, case):
    damage, named, still = DAMAGES[case]
    run_dir = _healthy(tmp_path / "run")
    damage(run_dir)
    for as_json in (False, True):
        result = run_main(["status", str(run_dir), "--plot", str(tmp_path / "curves.png")]
                          + ["--json"] * as_json, capfd, module=True)
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stdout + result.stderr
        warnings = [line for line in result.stderr.splitlines() if line.strip()]
        assert all(line.startswith("warning: ") for line in warnings), result.stderr
        if named:
            assert any(named in line for line in warnings), result.stderr
        if as_json:
            report = json.loads(result.stdout)
            assert report["warnings"] == [line.removeprefix("warning: ") for line in warnings]
        else:
            assert still in result.stdout, result.stdout


def test_status_of_a_healthy_stopped_run_has_no_warning_and_no_eta(tmp_path, capfd):
    """A run nobody holds is stopped: it has no ETA, however recent its records (a live run's is tested in
    tests/test_health.py)."""
    run_dir = _healthy(tmp_path / "run")
    result = run_main(["status", str(run_dir), "--json", "--plot", str(tmp_path / "c.png")], capfd, module=True)
    report = json.loads(result.stdout)
    assert result.stderr == "" and report["warnings"] == []
    assert (report["state"], report["step"], report["eta_s"]) == ("stopped", 6, 0.0)
    assert len(report["health"]["loss_spikes"]) == 1


def test_status_takes_the_step_from_goodput_where_metrics_are_empty(tmp_path, capfd):
    """A finished run whose metrics.jsonl was emptied is not "finished, step 0": goodput.json's last start
    reached the end, and status says so with a warning."""
    run_dir = _healthy(tmp_path / "run")
    record = json.loads((run_dir / "goodput.json").read_text())
    record["attempts"][0].update(last_step=STEPS, ended="finished")
    (run_dir / "goodput.json").write_text(json.dumps(record))
    (run_dir / "metrics.jsonl").write_text("")
    result = run_main(["status", str(run_dir), "--plot", str(tmp_path / "c.png")], capfd, module=True)
    assert f"finished, step {STEPS} of {STEPS}" in result.stdout
    assert "metrics.jsonl holds no step records" in result.stderr


def test_status_lists_hang_dumps_oldest_first(tmp_path, capfd):
    """By when they were written (then by step), not by name: step 10's dump sorts before step 9's by name."""
    run_dir = _healthy(tmp_path / "run")
    (run_dir / "hangs").mkdir()
    for age, step in ((300, 9), (100, 10)):
        dump = run_dir / "hangs" / f"process-0-step-{step}-step.txt"
        dump.write_text("stacks")
        os.utime(dump, (time.time() - age, time.time() - age))
    result = run_main(["status", str(run_dir), "--json", "--plot", str(tmp_path / "c.png")], capfd, module=True)
    assert json.loads(result.stdout)["health"]["hangs"] == ["process-0-step-9-step.txt", "process-0-step-10-step.txt"]


def test_status_with_a_plot_path_it_cannot_write_still_reports(tmp_path, capfd):
    run_dir = _healthy(tmp_path / "run")
    result = run_main(["status", str(run_dir), "--plot", str(tmp_path / "missing" / "c.png")], capfd, module=True)
    assert result.returncode == 0 and "step 6 of 20" in result.stdout
    assert result.stderr.startswith("warning: the loss curves cannot be written")
    assert "loss curves:" not in result.stdout


def _garbage_step(d):
    (d / "checkpoints" / "3").mkdir(parents=True)
    (d / "checkpoints" / "3" / "_CHECKPOINT_METADATA").write_text("{bad")


RUN_DAMAGES = {
    "no config": (lambda d: (d / "config.yaml").unlink(), "is not a run directory"),
    "config not yaml": (_write("config.yaml", "steps: [1\n  : :"), "is not valid YAML"),
    "no checkpoints": (lambda d: None, "no checkpoints in"),
    "checkpoints a file": (_write("checkpoints", "not a folder"), "no checkpoints in"),
    "an empty step folder": (lambda d: (d / "checkpoints" / "3").mkdir(parents=True), "has no readable metadata"),
    "a damaged step": (_garbage_step, "has no readable metadata"),
}
VERBS = {
    "ckpt inspect": lambda d, t: ["ckpt", "inspect", d],
    "convert fold-norms": lambda d, t: ["convert", "fold-norms", "--run-dir", d, "--out", f"{t}/folded"],
    "convert to-hf": lambda d, t: ["convert", "to-hf", "--run-dir", d, "--out", f"{t}/hf"],
    "logits": lambda d, t: ["logits", "--run-dir", d, "--tokens", f"{t}/tokens.npy", "--out", f"{t}/logits.npy"],
    "generate": lambda d, t: ["generate", "--run-dir", d, "--prompt", "hi", "--max-new-tokens", "2"],
}


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("case", RUN_DAMAGES)
def test_every_verb_that_reads_a_run_refuses_a_damaged_one_in_one_line(tmp_path, capfd, verb, case):
    import numpy as np

    damage, message = RUN_DAMAGES[case]
    run_dir = _healthy(tmp_path / "run")
    damage(run_dir)
    np.save(tmp_path / "tokens.npy", np.zeros((1, 4), np.int32))
    if verb == "ckpt inspect" and case in ("no config", "config not yaml"):
        message = "no checkpoints in"  # it reads checkpoints/ alone
    result = run_main(VERBS[verb](str(run_dir), str(tmp_path)), capfd, module=True)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0] and "Traceback" not in result.stdout


def test_a_damaged_step_is_one_line_in_a_process_of_its_own(tmp_path):
    """Orbax logs a damaged step's metadata file whole as an absl error before ours: left out (only a process of
    its own shows absl's lines on stderr)."""
    run_dir = _healthy(tmp_path / "run")
    _garbage_step(run_dir)
    result = run_cli(["ckpt", "inspect", str(run_dir)], module=True)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: checkpoint at step 3 in ")
