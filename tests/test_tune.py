"""`python -m scaletrain tune`: every candidate planned, the refused ones never proposed, the best by the plan
compiled, the fastest that fits by the compiled estimate written as a config that trains as it is, and an
interrupted search resumed from its --out."""

import json
from pathlib import Path

import pytest

from scaletrain import __main__ as cli
from scaletrain import config
from scaletrain.errors import ConfigError
from scaletrain.planner import sweep as sweep_lib
from scaletrain.planner import tune
from tests.conftest import ROOT

BASE = ROOT / "configs" / "llama_tiny.yaml"
# 2 layers of width 64, 8 sequences of 32: compiles in seconds. Four heads: mesh.tensor=8 is refused.
TINY = ("model.d_model=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16",
        "model.d_ff=128", "model.vocab_size=384", "data.seq_len=32", "train.global_batch=8")


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """The real search for the 8 CPU devices, two candidates compiled."""
    out = tmp_path_factory.mktemp("tune") / "out"
    lines = []
    best = tune.run(BASE, TINY, "cpu:8", budget=2, out=out, loop_correction=False, log=lines.append)
    return best, out, lines


def _plans(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / tune.PLANS).read_text().splitlines()]


def test_the_best_fits_compiles_and_trains_as_written(tuned, tmp_path):
    best, out, lines = tuned
    assert best is not None and best["status"] == "ok" and best["compile"]["fits"]
    assert any(line.startswith("[1/2]") for line in lines)  # progress while it compiles
    for name in (tune.BEST, tune.REPORT, tune.PLANS, sweep_lib.RESULTS, "summary.md", "sweep.png"):
        assert (out / name).is_file(), name
    # best.yaml is the base config with the winner's choices, loaded as train.py loads it.
    written = config.load(out / tune.BEST)
    assert written.to_dict() == config.load(BASE, best["overrides"]).to_dict()
    assert (out / tune.BEST).read_text().startswith("# Found by `python -m scaletrain tune")
    assert "**best**" in (out / tune.REPORT).read_text()
    # It trains as written: the sweep's run stage, a step after a warm-up one, on the 8 devices it was tuned for.
    spec = sweep_lib.Sweep(base=out / tune.BEST, common=(), stages=("run",), hardware=None, topology=None,
                           loop_correction=False, steps=1, variants=({},))
    assert sweep_lib._STAGE_FNS["run"](written, spec)["finite"]


def test_refused_candidates_are_planned_out_and_never_compiled(tuned):
    _, out, _ = tuned
    plans = _plans(out)
    refused = [p for p in plans if p["status"] == "refused"]
    assert refused and all("mesh.tensor=8" in p["reason"] for p in refused)  # 4 heads
    assert all(p["choices"].get("mesh.tensor") == 8 for p in refused)
    compiled = [json.loads(line) for line in (out / sweep_lib.RESULTS).read_text().splitlines()]
    assert all("mesh.tensor=8" not in r["overrides"] for r in compiled)
    # Every candidate planned to fit loads and passes the trainer's checks.
    for p in [p for p in plans if p["status"] == "fits"][:50]:
        config.load(BASE, [*TINY, *sweep_lib.overrides(p["choices"])])
    # The space covers what the issue names: meshes, presets, remat policies (custom too), logits blocks.
    keys = {k for p in plans for k in p["choices"]}
    assert {"mesh.data", "mesh.fsdp", "mesh.tensor", "sharding.preset", "remat.policy", "model.logits_block"} <= keys
    assert any(p["choices"].get("remat.policy") == "custom" for p in plans)


def _fake_compile(names: dict[str, str], times: dict[str, float], fits: dict[str, bool]):
    """A compile stage that reports the given step time and fit per candidate name (`names`: a candidate's
    config fingerprint -> its name): the ranking's own logic, without compiling."""
    def compile_(cfg, spec):
        name = names[config.config_hash(cfg)]
        return {"topology": spec.topology, "fits": fits.get(name, True), "hbm_per_device_bytes": 1 << 20,
                "hbm_capacity_bytes": 1 << 30, "xla_flops": 1.0, "xla_optimal_seconds": times[name],
                "xla_roofline_seconds": None, "xla_with_kernels_seconds": None, "loop_corrected": False,
                "collectives": {}, "compile_seconds": 0.0}
    return compile_


def test_ranked_by_the_compiled_estimate_not_the_plan(tmp_path, monkeypatch):
    """The plan's order reversed by the compile: the plan's last chosen candidate wins; one that does not fit
    when compiled never does, however fast; a rerun into the same folder compiles nothing again."""
    ranked = tune.search(BASE.resolve(), TINY, "cpu:8", 3, log=lambda line: None)
    selected = tune.select(ranked, 3)
    chosen = [r["name"] for r in selected]
    assert len(chosen) == 3
    names = {config.config_hash(config.load(BASE, [*TINY, *sweep_lib.overrides(r["choices"])])): r["name"]
             for r in selected}
    times = {name: 1.0 + 0.1 * (2 - i) for i, name in enumerate(chosen)}  # the plan's third is the fastest ...
    times[chosen[1]] = 0.5  # ... but the second is faster still, and does not fit
    monkeypatch.setitem(sweep_lib._STAGE_FNS, "compile", _fake_compile(names, times, {chosen[1]: False}))
    best = tune.run(BASE, TINY, "cpu:8", budget=3, out=tmp_path / "out", log=lambda line: None)
    assert best["name"] == chosen[2]
    report = (tmp_path / "out" / tune.REPORT).read_text()
    assert "does not fit" in report and "slower (compiled)" in report

    def no_compile(cfg, spec):
        raise AssertionError("a resumed search compiled again")

    monkeypatch.setitem(sweep_lib._STAGE_FNS, "compile", no_compile)
    lines = []
    again = tune.run(BASE, TINY, "cpu:8", budget=3, out=tmp_path / "out", log=lines.append)
    assert again["name"] == chosen[2] and any("kept from an earlier run" in line for line in lines)
    # Another search's results there (compiled without the loop correction) are refused, not mixed in.
    with pytest.raises(ConfigError, match="another sweep"):
        tune.run(BASE, TINY, "cpu:8", budget=3, out=tmp_path / "out", loop_correction=False, log=lambda line: None)


def test_a_compiled_tie_goes_to_the_less_memory():
    """Compiled steps within COMPILED_TIE (1%) are a tie - XLA's estimate is no measurement - broken by the less
    memory: the 70B's search compiled 24.74 s at 86.2 GiB and 24.78 s at 76.1 GiB (docs/tune.md)."""
    def compiled(name, seconds, gib):
        return {"name": name, "status": "ok", "compile": {"fits": True, "xla_with_kernels_seconds": seconds,
                                                          "hbm_per_device_bytes": gib * 2**30}}

    tight, roomy, slow = compiled("tight", 24.74, 86.2), compiled("roomy", 24.78, 76.1), compiled("slow", 25.3, 40.0)
    assert tune.winner([tight, roomy, slow]) is roomy
    assert "within 1%" in tune.verdict(tight, roomy) and "slower" in tune.verdict(slow, roomy)
    assert tune.winner([tight, slow]) is tight and tune.winner([]) is None


def test_zero_bubble_is_ranked_by_the_plans_estimate_not_xlas(tmp_path):
    """XLA's step time of a zero-bubble step is not the step's - its cost analysis counts every branch of the
    per-slot conditionals every tick, 11x the plan's estimate on the tiny step, where 1F1B's is 1.6x - and the
    compile says so (aot.time_warning). Ranked by it, zero-bubble could never win; it is ranked by the plan's
    estimate of the compiled step instead, and the table, the verdicts and best.yaml say so."""
    from scaletrain.planner import aot
    from scaletrain.train.runner import Runner

    warning = aot.time_warning(Runner(schedule="zero_bubble", stages=2, microbatches=4))

    def compiled(name, seconds, planned, comparable=True):
        return {"name": name, "status": "ok", "overrides": [f"pipeline.schedule={name}"],
                "plan": {"step_estimate_s": planned, "step_time_s": planned / 2, "memory_per_device_bytes": 2**30},
                "compile": {"fits": True, "xla_with_kernels_seconds": seconds, "hbm_per_device_bytes": 2**30,
                            "hbm_capacity_bytes": 2**33, "loop_corrected": True, "xla_time_comparable": comparable,
                            "warnings": [] if comparable else [warning]}}

    one_f_one_b, zero_bubble = compiled("1f1b", 1.6, 1.0), compiled("zero_bubble", 9.9, 0.9, comparable=False)
    assert tune.winner([one_f_one_b, zero_bubble]) is zero_bubble
    assert tune.verdict(one_f_one_b, zero_bubble) == "+77.8% slower (the plan's estimate for zero-bubble)"
    assert tune.winner([compiled("1f1b", 0.8, 1.0), zero_bubble])["name"] == "1f1b"
    spec = sweep_lib.Sweep(base=BASE, common=(), stages=("plan", "compile"), hardware="2xv5p:2x2x1",
                           topology="2xv5p:2x2x1", loop_correction=True, steps=1, variants=())
    report = tune.report([], [one_f_one_b, zero_bubble], zero_bubble, spec, 2)
    assert "| 1 | zero_bubble | 0.9 | 1.00 | 0.9 (the plan's) | 1.00 | **best** |" in report
    assert f"it is ranked by that: {warning}." in report
    header = tune.best_yaml(BASE, (), zero_bubble, "2xv5p:2x2x1", 2)
    assert "0.9 s per step (the plan's estimate: XLA's is not this schedule's step)" in header


def test_a_search_where_nothing_fits_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sweep_lib._STAGE_FNS, "compile", lambda cfg, spec: {
        "topology": spec.topology, "fits": False, "hbm_per_device_bytes": 1 << 31, "hbm_capacity_bytes": 1 << 30,
        "xla_flops": None, "xla_optimal_seconds": None, "xla_roofline_seconds": None,
        "xla_with_kernels_seconds": None, "loop_corrected": False, "collectives": None, "compile_seconds": 0.0})
    code = cli.main(["tune", "--config", str(BASE), *[a for s in TINY for a in ("--set", s)], "--topology", "cpu:8",
                     "--budget", "1", "--out", str(tmp_path / "out")])
    assert code == cli.EXIT_DOES_NOT_FIT
    assert not (tmp_path / "out" / tune.BEST).exists()
    assert "does not fit" in (tmp_path / "out" / tune.REPORT).read_text()


def test_an_out_of_another_search_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """docs/tune.md: another search's results in --out - here another --set, which makes another base config as
    much as an edited file does - are refused with one error line before the search, nothing there changed; so
    are another search's plans where it compiled nothing (the compiles' results.jsonl gone here)."""
    monkeypatch.setitem(sweep_lib._STAGE_FNS, "compile", lambda cfg, spec: {
        "topology": spec.topology, "fits": True, "hbm_per_device_bytes": 1 << 20, "hbm_capacity_bytes": 1 << 30,
        "xla_flops": 1.0, "xla_optimal_seconds": 1.0, "xla_roofline_seconds": None, "xla_with_kernels_seconds": None,
        "loop_corrected": False, "collectives": {}, "compile_seconds": 0.0})
    out = tmp_path / "out"
    args = ["tune", "--config", str(BASE), *[a for s in TINY for a in ("--set", s)], "--topology", "cpu:8",
            "--budget", "1", "--out", str(out)]
    assert cli.main(args) == 0
    capsys.readouterr()
    written = {p.name: p.read_bytes() for p in out.iterdir()}
    another = [*args, "--set", "optim.learning_rate=0.001"]
    assert cli.main(another) == cli.EXIT_USAGE
    assert capsys.readouterr().err == (f"error: {out / sweep_lib.RESULTS} holds the results of another sweep "
                                       "(different common); use a new --out or delete the folder\n")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == written
    (out / sweep_lib.RESULTS).unlink()
    assert cli.main(another) == cli.EXIT_USAGE
    assert capsys.readouterr().err == (f"error: {out / tune.PLANS} holds the plans of another search (different "
                                       "common); use a new --out or delete the folder\n")
    assert cli.main(args) == 0  # the same search resumes


def test_bad_input_is_one_error_line(tmp_path, capsys):
    args = ["tune", "--config", str(BASE), "--topology", "cpu:8", "--out", str(tmp_path / "out")]
    assert cli.main([*args, "--budget", "0"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err.startswith("error: --budget must be at least 1")
    assert cli.main([*args, "--set", "model.d_modle=64"]) == cli.EXIT_USAGE
    assert "unknown config key" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert cli.main([*args[:-1], str(tmp_path / "file")]) == cli.EXIT_USAGE
    assert "already exists" in capsys.readouterr().err


def test_the_context_degree_is_searched_where_the_config_splits_its_sequences():
    """A long-context config (mesh.context set) gets every context degree among its candidates; any other keeps
    its sequences whole (context 1): the search space grows only where the user asked for the axis."""
    long = config.load(BASE, [*TINY, "mesh.context=2"])
    degrees = {mesh["mesh.context"] for mesh in tune.meshes(long, 8, 1)}
    assert degrees == {1, 2, 4, 8}
    plain = config.load(BASE, list(TINY))
    assert {mesh["mesh.context"] for mesh in tune.meshes(plain, 8, 1)} == {1}
    # Where a candidate splits its sequences, both context attentions; where it does not, only the config's.
    attentions = {}
    for choices in tune.space(long, 8, 1):
        attentions.setdefault(choices["mesh.context"] > 1, set()).add(choices["model.context_attention"])
    assert attentions == {True: {"allgather", "ring"}, False: {"allgather"}}


def test_across_slices_the_search_has_every_axis_and_the_1f1b_and_zero_bubble_schedules():
    """On two slices the search puts data, fsdp or the pipeline across them - the pipeline with 1F1B,
    interleaved 1F1B where the layers divide into 2 blocks a stage, and zero-bubble - and tune.md names the best
    of each."""
    cfg = config.load(BASE, [*TINY, "model.num_layers=4"])
    schedules = {(c.get("pipeline.schedule"), c.get("pipeline.repeats")) for c in tune.space(cfg, 4, 2)
                 if c["mesh.dcn_pipeline"] > 1}
    assert schedules == {("1f1b", None), ("interleaved_1f1b", 2), ("zero_bubble", None)}
    assert {c.get("pipeline.schedule") for c in tune.space(config.load(BASE, list(TINY)), 4, 2)
            if c["mesh.dcn_pipeline"] > 1} == {"1f1b", "zero_bubble"}  # 2 layers: one block a stage
    assert {a for a in ("data", "fsdp", "pipeline") for c in tune.space(cfg, 4, 2) if c[f"mesh.dcn_{a}"] == 2} == {
        "data", "fsdp", "pipeline"}

    def record(name, across, seconds, status="fits"):
        return {"name": name, "status": status, "choices": {},
                "plan": {"step_time_s": seconds, "memory_per_device_bytes": 2**30, "across": across}}

    ranked = [record("a", "fsdp", 1.0, "does not fit"), record("b", "data", 2.0), record("c", "data", 2.1),
              record("d", "pipeline", 2.5)]
    lines = tune.across_slices(ranked)
    assert lines[1] == "## Across the slices: the best of each by the plan"
    assert [line.split(" | ")[:3] for line in lines[5:]] == [["| data", "2", "b"], ["| pipeline", "4", "d"]]
    assert "+25.0%" in lines[6]
    assert tune.across_slices(ranked[:3]) == []  # one axis only: nothing to compare
    # The axis across the slices is the plan's, whether the candidate sets it or the base config does.
    base = config.load(BASE, [*TINY, "mesh.dcn_data=2"])
    planned = tune.evaluate(BASE, (*TINY, "mesh.dcn_data=2"), base, {"mesh.dcn_data": 2}, "2xv5p:2x2x1")
    assert (planned["choices"], planned["plan"]["across"]) == ({}, "data")
