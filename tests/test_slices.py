"""`plan --across-slices` (planner/slices.py): data parallelism, FSDP and every pipeline schedule across the slices
of a multi-slice topology planned side by side, the winner, and the DCN bandwidth where it flips."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaletrain.planner import slices, tune
from tests.conftest import run_main

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "llama3_70b.yaml"
# Llama-2-70B's shapes at 2 x 4096 tokens a chip over two v5p-64 slices: docs/pipeline.md's comparison.
COMMON = ("model.vocab_size=32000", "model.rope_scaling=none", "model.rope_theta=10000", "data.seq_len=4096",
          "train.global_batch=128", "model.attention=xla", "remat.policy=full", "train.grad_accum_steps=1",
          "mesh.fsdp=32")
HARDWARE = "2xv5p:4x4x2"


@pytest.fixture(scope="module")
def verdict():
    with pytest.MonkeyPatch.context() as mp:  # a coarser search than the command's: the same answers, fewer plans
        mp.setattr(slices, "FACTORS", (1 / 64, 1 / 16, 1 / 4, 4.0))
        mp.setattr(slices, "BISECTIONS", 5)
        mp.setattr(slices, "SLICE_COUNTS", (2, 4))
        yield slices.verdict(CONFIG, COMMON, HARDWARE)


def _pipeline_wins(bandwidth: float) -> bool:
    return slices.best(slices.planned(CONFIG, COMMON, HARDWARE, bandwidth))["family"] == "pipeline"


def test_every_schedule_is_planned_and_the_winner_is_the_best(verdict):
    """Every family and every schedule has a layout the trainer accepts; the winner ranks first of all of them,
    each family's best first of its own (tune's ranking); a pipeline sends the fewest bytes over DCN and pays
    a bubble for it, and more microbatches or blocks a stage shrink the bubble, as zero-bubble's weight slots do."""
    records = slices.planned(CONFIG, COMMON, HARDWARE)
    allowed = [r for r in records if r["status"] != "refused"]
    assert {r["family"] for r in allowed} == set(slices.FAMILIES)
    assert set(verdict["schedules"]) == {"gpipe x1", "circular x2", "1f1b x1", "interleaved_1f1b x2",
                                         "interleaved_1f1b x4", "zero_bubble x1"}
    key = tune.rank_key
    assert key(verdict["winner"]) == min(key(r) for r in allowed)
    for family, b in verdict["best"].items():
        assert key(b) == min(key(r) for r in allowed if r["family"] == family)
    pipe, data = verdict["best"]["pipeline"]["plan"], verdict["best"]["data"]["plan"]
    assert pipe["dcn_bytes"] < data["dcn_bytes"] < verdict["best"]["fsdp"]["plan"]["dcn_bytes"]
    assert pipe["bubble"] > 0 == data["bubble"]
    bubbles = {k: r["plan"]["bubble"] for k, r in verdict["schedules"].items()}
    assert bubbles["interleaved_1f1b x4"] < bubbles["interleaved_1f1b x2"] < bubbles["1f1b x1"]
    assert bubbles["zero_bubble x1"] < bubbles["1f1b x1"]


def test_the_flip_is_where_the_winner_changes(verdict):
    """At v5p's DCN no pipeline wins this step; just below the bandwidth the verdict names one does, just above
    none does - and searching from the other side finds the same bandwidth."""
    at, bandwidth = verdict["flip_dcn_bandwidth"], verdict["dcn_bandwidth"]
    assert not verdict["pipeline_wins"] and at < bandwidth
    assert _pipeline_wins(0.97 * at) and not _pipeline_wins(1.03 * at)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(slices, "FACTORS", (1 / 4, 4.0, 16.0))
        mp.setattr(slices, "BISECTIONS", 5)
        below = slices.planned(CONFIG, COMMON, HARDWARE, at / 3)
        assert slices.flip(CONFIG, COMMON, HARDWARE, below, at / 3) == pytest.approx(at, rel=0.03)


def test_the_flip_is_searched_both_ways():
    """The tiny model on two 8-GPU nodes: its stage activations outweigh the gradients data parallelism reduces,
    so the pipeline wins at the nodes' own bandwidth and loses below the flip - which lies above a slower DCN,
    not below."""
    tiny = ROOT / "configs" / "llama_tiny.yaml"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(slices, "FACTORS", (1 / 16, 1 / 4, 4.0))
        mp.setattr(slices, "BISECTIONS", 5)
        mp.setattr(slices, "SLICE_COUNTS", (2,))
        v = slices.verdict(tiny, (), "h100:16")
    at = v["flip_dcn_bandwidth"]
    assert v["pipeline_wins"] and at < v["dcn_bandwidth"] and not v["pipeline_wins_below_flip"]
    wins = [slices.best(slices.planned(tiny, (), "h100:16", f * at))["family"] == "pipeline" for f in (0.97, 1.03)]
    assert wins == [False, True]
    assert "Flip: no pipeline wins below" in slices.format_table(v)


def test_slice_counts_keep_the_tokens_per_chip(verdict):
    """Four slices plan the batch doubled: the same tokens a chip; the pipeline's bubble grows with its stages."""
    two, four = verdict["by_slices"][2], verdict["by_slices"][4]
    assert two["winner"] is verdict["winner"]
    assert four["data"]["plan"]["memory_per_device_bytes"] == pytest.approx(
        two["data"]["plan"]["memory_per_device_bytes"], rel=0.02)
    assert four["pipeline"]["plan"]["bubble"] > two["pipeline"]["plan"]["bubble"]
    table = slices.format_table(verdict)
    assert "Verdict: fsdp across the slices" in table and "Flip: a pipeline wins below" in table and "- 4: " in table


def test_the_command_refuses_one_slice(capfd):
    result = run_main(["plan", "--config", str(CONFIG), "--hardware", "v5p:4x4x2", "--across-slices"], capfd,
                      module=True)
    assert result.returncode == 2 and "error: --across-slices compares layouts across slices" in result.stderr
    result = run_main(["plan", "--config", str(CONFIG), "--hardware", HARDWARE, "--across-slices", "--tokens",
                       "1e12"], capfd, module=True)
    assert result.returncode == 2 and "error: --across-slices compares layouts for one step" in result.stderr


@pytest.mark.parametrize("accumulation", [(), ("train.grad_accum_steps=1",)])
def test_data_parallelism_and_fsdp_get_microbatches_as_a_pipeline_does(accumulation, capfd):
    """The README's Llama 3 8B on two v5p-64 slices. As the config is (4 microbatches), every pipeline was refused
    - its microbatches replace accumulation - and 32 sequences a microbatch do not divide over 64 chips; at one
    microbatch, data parallelism and FSDP did not fit (162 GiB), so a pipeline won by default. Every family has
    its microbatches - accumulated or scheduled - and FSDP over 2 of them fits and wins."""
    llama_8b = ROOT / "configs" / "llama3_8b.yaml"
    records = slices.planned(llama_8b, accumulation, HARDWARE)
    for family in slices.FAMILIES:
        assert slices.best(records, (family,))["status"] == "fits", family
    assert all(r["layout"]["train.grad_accum_steps"] == 1 for r in records if r["family"] == "pipeline")
    winner = slices.best(records)
    assert winner["family"] == "fsdp" and winner["layout"]["train.grad_accum_steps"] == 2
    with pytest.MonkeyPatch.context() as mp:  # the README's command, on a coarser search for the flip
        mp.setattr(slices, "FACTORS", (1 / 64, 1 / 16, 4.0))
        mp.setattr(slices, "BISECTIONS", 2)
        mp.setattr(slices, "SLICE_COUNTS", (2,))
        result = run_main(["plan", "--config", str(llama_8b), "--hardware", HARDWARE, "--across-slices",
                           *(a for o in accumulation for a in ("--set", o))], capfd, module=True)
    assert result.returncode == 0, result.stderr
    assert "Verdict: fsdp across the slices, 2 microbatches" in result.stdout
