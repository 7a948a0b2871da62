"""`python -m scaletrain sweep`: variants of a base config planned, compiled and run, their results written as
results.jsonl, summary.md and sweep.png, invalid variants recorded, disagreements between views flagged."""

import json
from pathlib import Path

import pytest

from scaletrain import config
from scaletrain.errors import ConfigError
from scaletrain.planner import sweep as sweep_lib
from tests.conftest import ROOT

TINY = ["model.d_model=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16",
        "model.d_ff=128", "model.vocab_size=384", "data.seq_len=32", "train.global_batch=8", "mesh.fsdp=-1"]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A 2-layer model on the 8 CPU devices at tensor 1, 2 and 3 (fsdp fills what tensor leaves; 3 does not divide
    8: the invalid variant) and data-parallel, every stage."""
    tmp = tmp_path_factory.mktemp("sweep")
    path = _write(tmp, f"""
base: {ROOT / 'configs' / 'llama_tiny.yaml'}
set: {json.dumps(TINY)}
stages: [plan, compile, run]
hardware: cpu:8
loop_correction: false
steps: 2
grid:
  mesh.tensor: [1, 2, 3]
variants:
  - {{mesh.data: 8, sharding.preset: dp}}
""")
    spec = sweep_lib.load(path)
    assert spec.topology == "cpu:8"  # compile defaults to the planned hardware
    return sweep_lib.run(spec, tmp / "out", log=lambda line: None), tmp / "out"


def test_every_stage_of_every_valid_variant_is_recorded(swept):
    records, out = swept
    assert [r["name"] for r in records] == ["tensor=1", "tensor=2", "tensor=3", "data=8 preset=dp"]
    # 8 devices are not a multiple of tensor=3: recorded, and the sweep went on.
    assert [r["status"] for r in records] == ["ok", "ok", "invalid", "ok"]
    assert "mesh.tensor=3" in records[2]["error"]
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["name"] for r in lines] == [r["name"] for r in records]
    for r in (r for r in lines if r["status"] == "ok"):
        assert r["plan"]["step_time_s"] > 0 and r["plan"]["memory_per_device_bytes"] > 0
        assert r["compile"]["fits"] and r["compile"]["hbm_per_device_bytes"] > 0 and r["compile"]["xla_flops"] > 0
        assert r["run"]["finite"] and len(r["run"]["losses"]) == 3 and r["run"]["step_time_s"] > 0
    # The same model: the same first loss on every mesh.
    first = [r["run"]["losses"][0] for r in lines if r["status"] == "ok"]
    assert max(first) - min(first) < 1e-4


def test_summary_ranks_by_the_best_step_time_and_the_plot_is_written(swept):
    records, out = swept
    text = (out / "summary.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| rank")]
    ranked = [line.split(" | ")[1] for line in rows if not line.startswith("| -")]
    measured = sorted((r["run"]["step_time_s"], r["name"]) for r in records if r["status"] == "ok")
    assert ranked == [n for _, n in measured]
    assert sum("invalid" in line for line in rows) == 1
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_checks_flag_only_differences_over_the_tolerance():
    spec = sweep_lib.Sweep(base=Path("x"), common=(), stages=sweep_lib.STAGES, hardware="cpu:8", topology="cpu:8",
                           loop_correction=False, steps=1, variants=({},))
    record = {"plan": {"chip": "cpu", "step_time_s": 1.0, "memory_per_device_bytes": 100.0},
              "compile": {"topology": "cpu:8", "xla_flops": 1.0, "xla_optimal_seconds": None,
                          "xla_roofline_seconds": 1.2, "hbm_per_device_bytes": 130.0},
              "run": {"chip": "cpu", "step_time_s": 1.5, "memory_per_device_bytes": 110.0}}
    flags = sweep_lib.checks(record, spec)
    # plan 1.0 vs XLA 1.2 (-17%) and vs run 1.5 (-33%); memory 100 vs 130 (-23%) and vs 110 (-9%); XLA 1.2 vs
    # run 1.5 (-20%): only the second is over 25%.
    assert flags == ["step time: plan 1 s vs run 1.5 s (-33%)"]


def test_a_step_time_the_compile_calls_not_comparable_is_not_ranked_as_xlas(monkeypatch):
    """A zero-bubble compile's step time is not the step's (aot.time_warning): the compile stage keeps its
    warning, the checks show it in place of a plan-against-XLA flag, and the variant is ranked by the plan's
    estimate of the compiled step."""
    from scaletrain.planner import aot

    warning = "XLA's step time is not comparable"
    monkeypatch.setattr(aot, "compile_step", lambda cfg, topology, loop_correction: {
        "topology": topology, "fits": True, "hbm_per_device_bytes": 100.0, "hbm_capacity_bytes": 1e9,
        "xla_flops": 1.0, "xla_optimal_seconds": 11.0, "xla_roofline_seconds": 9.0, "xla_with_kernels_seconds": None,
        "loop_corrected": True, "collectives": {}, "compile_seconds": 1.0, "xla_time_comparable": False,
        "warnings": [warning]})
    spec = sweep_lib.Sweep(base=Path("x"), common=(), stages=("plan", "compile"), hardware="v5p:2x2x1",
                           topology="v5p:2x2x1", loop_correction=True, steps=1, variants=({},))
    record = {"plan": {"chip": "v5p", "step_time_s": 0.5, "step_estimate_s": 1.0, "memory_per_device_bytes": 100.0},
              "compile": sweep_lib._compile(None, spec)}
    assert sweep_lib.xla_time(record["compile"]) is None
    assert sweep_lib.checks(record, spec) == [f"compile: {warning}"]
    assert sweep_lib.best_time(record) == (1.0, "plan's estimate")


@pytest.mark.parametrize("text, says", [
    ("base: a.yaml\nvariants: [{mesh.fsdp: 2}]\nstagez: [plan]", "unknown key(s) stagez"),
    ("base: a.yaml\nstages: [plan]\nvariants: [{mesh.fsdp: 2}]", "needs 'hardware'"),
    ("base: a.yaml\nstages: [run]", "no variants"),
    ("base: a.yaml\nstages: [run]\ngrid: {mesh.fsdp: 2}", "non-empty lists"),
    ("base: a.yaml\nstages: [fly]\nvariants: [{mesh.fsdp: 2}]", "expected a list of plan, compile, run"),
    ("variants: [{mesh.fsdp: 2}]", "'base'"),
])
def test_bad_sweep_files_are_refused(tmp_path, text, says):
    with pytest.raises(ConfigError, match=".*" + says.replace("(", r"\(").replace(")", r"\)")):
        sweep_lib.load(_write(tmp_path, text))


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_example_sweeps_are_valid(path, monkeypatch):
    """Every variant of the committed sweeps loads and plans on the sweep's hardware (its mesh fits the chips)."""
    from scaletrain.facts import hardware
    from scaletrain.planner import roofline

    monkeypatch.setattr(hardware, "cpu_peak", lambda: 1e11)  # cpu:N without measuring this machine
    monkeypatch.setattr(hardware, "cpu_bandwidth", lambda: 1e10)
    spec = sweep_lib.load(path)
    assert len(spec.variants) >= 4
    for variant in spec.variants:
        cfg = config.load(spec.base, [*spec.common, *sweep_lib.overrides(variant)])
        assert roofline.plan(cfg, spec.hardware)["fits"]


@pytest.mark.parametrize("content, says", [(b"base: a.yaml", "needs 'hardware'"),
                                           (b"base: \xff.yaml\n", "not UTF-8 text")])
def test_the_command_refuses_a_bad_sweep_file_in_one_line(tmp_path, capsys, content, says):
    from scaletrain.__main__ import main

    path = tmp_path / "sweep.yaml"
    path.write_bytes(content)
    assert main(["sweep", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and says in err
    assert not (tmp_path / "o").exists()


def _plan_sweep(tmp_path: Path, variants: str, hardware: str = "v5p:2x2x1") -> Path:
    """A plan-only sweep: planning for a TPU slice is arithmetic, milliseconds a variant."""
    return _write(tmp_path, f"base: {ROOT / 'configs' / 'llama_tiny.yaml'}\nset: {json.dumps(TINY)}\nstages: [plan]\n"
                            f"hardware: {hardware}\nvariants: {variants}\n")


def test_a_rerun_into_the_same_folder_keeps_what_was_recorded_and_runs_the_rest(tmp_path, monkeypatch):
    planned = []
    real_plan = sweep_lib._STAGE_FNS["plan"]

    def plan(cfg, sweep):
        planned.append(cfg.mesh.tensor)
        if cfg.mesh.tensor == 4:
            raise RuntimeError("a passing failure")
        return real_plan(cfg, sweep)

    monkeypatch.setitem(sweep_lib._STAGE_FNS, "plan", plan)
    out, quiet = tmp_path / "out", (lambda line: None)
    first = sweep_lib.run(sweep_lib.load(_plan_sweep(tmp_path, "[{mesh.tensor: 1}, {mesh.tensor: 4}, "
                                                               "{mesh.tensor: 3}]")), out, log=quiet)
    assert [r["status"] for r in first] == ["ok", "failed", "invalid"] and planned == [1, 4, 3]
    recorded = (out / "results.jsonl").read_text()

    planned.clear()
    monkeypatch.setitem(sweep_lib._STAGE_FNS, "plan", lambda cfg, sweep: planned.append(cfg.mesh.tensor) or
                        real_plan(cfg, sweep))
    log = []
    spec = sweep_lib.load(_plan_sweep(tmp_path, "[{mesh.tensor: 1}, {mesh.tensor: 4}, {mesh.tensor: 3}, "
                                                "{mesh.tensor: 2}]"))
    second = sweep_lib.run(spec, out, log=log.append)
    assert planned == [4, 2]  # the failed variant and the new one; the ok and invalid ones are kept
    assert [r["status"] for r in second] == ["ok", "ok", "invalid", "ok"] and second[0] == first[0]
    assert log[1] == "    ok, kept from an earlier run" and log[5] == "    invalid, kept from an earlier run"
    text = (out / "results.jsonl").read_text()
    assert text.startswith(recorded) and len(text.splitlines()) == 5  # appended, nothing replaced
    assert "tensor=2" in (out / "summary.md").read_text()


@pytest.mark.parametrize("change", ["hardware", "base"])
def test_a_rerun_refuses_a_folder_of_another_sweep_in_one_line(tmp_path, capsys, change):
    from scaletrain.__main__ import main

    base = tmp_path / "base.yaml"
    base.write_text((ROOT / "configs" / "llama_tiny.yaml").read_text())
    path = _write(tmp_path, f"base: base.yaml\nset: {json.dumps(TINY)}\nstages: [plan]\nhardware: v5p:2x2x1\n"
                            "variants: [{mesh.tensor: 1}]\n")
    out = tmp_path / "out"
    sweep_lib.run(sweep_lib.load(path), out, log=lambda line: None)
    if change == "hardware":
        path.write_text(path.read_text().replace("v5p:2x2x1", "v5p:2x2x2"))
    else:
        base.write_text(base.read_text() + "\nseed: 1\n")
    recorded = (out / "results.jsonl").read_text()
    assert main(["sweep", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    differ = "hardware" if change == "hardware" else "base_sha256"
    assert err == (f"error: {out / 'results.jsonl'} holds the results of another sweep (different {differ}); use a "
                   "new --out or delete the folder\n")
    assert (out / "results.jsonl").read_text() == recorded


def test_a_missing_base_config_is_the_sweep_files_error(tmp_path, capsys):
    from scaletrain.__main__ import main

    path = _write(tmp_path, "base: missing.yaml\nstages: [run]\nvariants: [{steps: 1}]\n")
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"error: sweep file {path}: base config '{tmp_path / 'missing.yaml'}' not "
                                       "found; expected a YAML file such as configs/llama_tiny.yaml\n")
    assert not (tmp_path / "out").exists()


def test_a_sweep_varies_the_pipeline_axis(tmp_path):
    """Pipeline variants are planned like any other: their bubble and schedule in the record, ranked with the
    rest."""
    spec = sweep_lib.load(_plan_sweep(tmp_path, "[{mesh.pipeline: 1}, {mesh.pipeline: 2, pipeline.microbatches: 4}]"))
    flat, staged = sweep_lib.run(spec, tmp_path / "out", log=lambda line: None)
    assert flat["status"] == staged["status"] == "ok"
    assert flat["plan"]["pipeline_bubble"] == 0 and staged["plan"]["pipeline_bubble"] == pytest.approx(0.2)
    assert "pipeline=2" in (tmp_path / "out" / "summary.md").read_text()
