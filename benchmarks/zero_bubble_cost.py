"""Why a compile cannot time zero-bubble's step: XLA's cost analysis counts every branch of its per-slot
conditionals every tick, whichever one runs (docs/pipeline.md, "Not yet").

The tiny model (configs/llama_tiny.yaml, XLA's attention, remat policy none) compiled through libtpu for
v5p:2x2x2, unrolled as the AOT tests compile it: data parallelism over the 8 chips, and zero-bubble over 2 stages
of 4 microbatches x fsdp 4. It prints each step's XLA FLOPs and the plan's executed FLOPs, and the two ratios;
no TPU needed. A second part prints what the plan's lockstep makes of the same table when the input slot costs
twice the others (a lean zero-bubble that ran each layer's forward again there), against 1F1B's 4 (M + P - 1).

    python benchmarks/zero_bubble_cost.py
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from scaletrain import config  # noqa: E402
from scaletrain.parallel import pipeline_zb  # noqa: E402
from scaletrain.planner import aot, roofline  # noqa: E402

TOPOLOGY = "v5p:2x2x2"
COMMON = ["model.attention=xla", "remat.policy=none"]
LAYOUTS = {"data": ["mesh.fsdp=8"],
           "zero_bubble": ["mesh.fsdp=4", "mesh.pipeline=2", "pipeline.microbatches=4",
                           "pipeline.schedule=zero_bubble"]}


def compiled_and_planned(overrides: list[str]) -> tuple[float, float]:
    """(XLA's FLOPs of the unrolled step, the plan's executed FLOPs: model, recomputed and attention's excess
    over the bubble)."""
    cfg = config.load("configs/llama_tiny.yaml", [*COMMON, *overrides])
    plan = roofline.plan(cfg, TOPOLOGY)
    executed = (plan["step_flops"] + plan["recompute_flops"] + plan["attention_extra_flops"]) / (
        1 - plan["pipeline_bubble"])
    return aot.unrolled_cost(cfg, aot.topology_devices(TOPOLOGY))["flops"], executed


def main() -> None:
    (data, data_plan), (zb, zb_plan) = (compiled_and_planned(LAYOUTS[k]) for k in ("data", "zero_bubble"))
    print(f"XLA FLOPs: zero-bubble {zb:.4g} / data {data:.4g} = {zb / data:.2f}x")
    print(f"plan:      zero-bubble {zb_plan:.4g} / data {data_plan:.4g} = {zb_plan / data_plan:.2f}x")
    stages, microbatches = 2, 4
    lean = 4 * microbatches / (1 - pipeline_zb.bubble(stages, microbatches, (1.0, 2.0, 1.0)))
    print(f"input slot at twice the others: {lean:g} slot-times a step, 1F1B {4 * (microbatches + stages - 1)}")


if __name__ == "__main__":
    main()
