"""Features compose: every pairing that docs/parallelism.md's table says composes trains 4 steps on 8 simulated
devices exactly like one device (loss, gradient norm, parameters and Adam's first moment within 1e-5, fp32), and
every pairing it refuses is refused with its reason.

The pairings here are the ones that were refused before the stack runner was chosen once (runner.py): a pipeline
of every schedule with flash attention, with a mixture of experts (its router losses and statistics summed across
stages and microbatches exactly as without stages) and with the parameters in host memory - the three together
in one run per schedule, against one device with neither stages nor offload. Elsewhere, beside runs those modules
make anyway: the parameters in host memory with gradient accumulation in tests/test_parallel.py's matrix case
"fsdp data=1 fsdp=2 tensor=4"; the optimizer state alone in host memory (optim.offload, whose update runs after
the pipeline) with each schedule - gpipe and circular in tests/test_pipeline.py, 1f1b and interleaved_1f1b in
tests/test_pipeline_1f1b.py, zero_bubble in tests/test_context.py (context=2 x pipeline=2 x fsdp=2)."""

import jax
import pytest

from scaletrain import config
from scaletrain.errors import ConfigError
from scaletrain.train import trainer
from tests import equivalence
from tests.conftest import tiny_overrides

STEPS = 4
MODEL = ["model.num_layers=4", "optim.eps=3e-3"]  # eps = lr: a rounding difference stays one (tests/test_pipeline.py)
# Router losses far above their defaults, so that a penalty's gradient lost or doubled in a schedule's hand-written
# backward pass shows in the gradient norm.
MOE = ["model.num_experts=4", "model.experts_per_token=2", "model.moe_d_ff=64", "model.router_aux_loss=0.5",
       "model.router_z_loss=0.2"]
ROUTER_METRICS = ("router_aux_loss", "router_z_loss", "expert_load_max", "dropped_fraction")
# The model every schedule trains: flash attention and a mixture of experts in every layer.
FEATURES = ["model.attention=flash", *MOE]

SCHEDULES = {
    "gpipe": ["mesh.pipeline=2", "pipeline.microbatches=4"],
    "circular": ["mesh.pipeline=2", "pipeline.schedule=circular", "pipeline.repeats=2", "pipeline.microbatches=4"],
    "1f1b": ["mesh.pipeline=2", "pipeline.schedule=1f1b", "pipeline.microbatches=4"],
    "interleaved_1f1b": ["mesh.pipeline=2", "pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2",
                         "pipeline.microbatches=4"],
    "zero_bubble": ["mesh.pipeline=2", "pipeline.schedule=zero_bubble", "pipeline.microbatches=4"],
}
# The rest of the 8-device mesh beside the 2 stages: 2 ways of the batch (a microbatch of the 8 rows is 2) and 2 of
# tensor (flash's 2 key/value heads split, sequence parallelism). The batch's 2 ways are `expert` (expert
# parallelism inside the stages) for gpipe, 1f1b and zero_bubble, `fsdp` (the host-memory parameters sharded
# over it) for circular and interleaved_1f1b.
BESIDE = {
    "gpipe": ["mesh.expert=2", "mesh.tensor=2"],
    "circular": ["mesh.fsdp=2", "mesh.tensor=2"],
    "1f1b": ["mesh.expert=2", "mesh.tensor=2"],
    "interleaved_1f1b": ["mesh.fsdp=2", "mesh.tensor=2"],
    "zero_bubble": ["mesh.expert=2", "mesh.tensor=2"],
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_pipeline_composes_with_flash_experts_and_parameter_offload(batches, schedule):
    """Each schedule with flash attention, a mixture of experts (the four router metrics compared every step
    too) and the parameters (so the moments too) in host memory, against one device with the same model and the
    state on the device: a feature that went wrong under the schedule - flash's or the router's gradient, the
    router's sums over stages and microbatches, the stage's weights fetched from host memory - shows in the loss,
    the gradient norm, a router metric, a parameter or Adam's moment."""
    want = equivalence.reference(batches, *MODEL, *FEATURES)
    got = equivalence.run(batches, *MODEL, *FEATURES, "params.offload=true", *SCHEDULES[schedule],
                          *BESIDE[schedule])
    equivalence.assert_same(got, want, metrics=("loss", "grad_norm") + ROUTER_METRICS)
    # Trained from host memory, a stage's weights fetched whole (runner.py).
    assert not got.setup.runner.fetches_layers
    kinds = {s.memory_kind for s in jax.tree.leaves(got.setup.state_shardings.params)}
    assert kinds == {"pinned_host"}


def test_the_router_penalty_shows_in_the_gradient_norm(batches):
    """What makes the mixture-of-experts pairings able to fail: a schedule that lost the penalty's gradient (1F1B
    pulls it through its hand-written backward slots, pipeline_1f1b.py) would train on the cross-entropy alone,
    whose gradient norm differs from the penalised one's by more than the tests' 1e-5."""
    plain = equivalence.reference(batches, *MODEL, *FEATURES, "model.router_aux_loss=0", "model.router_z_loss=0")
    penalised = equivalence.reference(batches, *MODEL, *FEATURES)
    assert abs(penalised.grad_norms[0] - plain.grad_norms[0]) > 1e-3 * plain.grad_norms[0]


@pytest.mark.parametrize("overrides, reason", [
    (["train.grad_accum_steps=2", "mesh.pipeline=2"], "the pipeline's microbatches replace gradient accumulation"),
    (["mesh.pipeline=2", "pipeline.schedule=1f1b", "pipeline.repeats=2"],
     "pipeline.repeats=2 needs pipeline.schedule=circular or interleaved_1f1b \\(got 1f1b\\)"),
    (["mesh.pipeline=2", "pipeline.schedule=gpipe", "pipeline.gather_weights=once"],
     "pipeline.gather_weights=once needs pipeline.schedule=1f1b, interleaved_1f1b or zero_bubble \\(got gpipe\\)"),
    (["mesh.pipeline=2", "pipeline.schedule=circular", "pipeline.keep=stage_inputs"],
     "pipeline.keep=stage_inputs needs pipeline.schedule=1f1b or interleaved_1f1b \\(got circular\\)"),
    (["mesh.pipeline=2", "pipeline.schedule=zero_bubble", "pipeline.keep=stage_inputs"],
     "pipeline.keep=stage_inputs needs pipeline.schedule=1f1b or interleaved_1f1b \\(got zero_bubble\\): GPipe and "
     "circular keep what their remat policy says, zero_bubble its layers' residuals"),
    (["mesh.pipeline=2", "pipeline.schedule=zero_bubble", "pipeline.repeats=2"],
     "pipeline.repeats=2 needs pipeline.schedule=circular or interleaved_1f1b \\(got zero_bubble\\)"),
    (["mesh.pipeline=2", "pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2", "pipeline.microbatches=3"],
     "pipeline.microbatches=3 is not a multiple of mesh.pipeline=2: interleaved 1F1B sends microbatches round the "
     "stages in groups of 2"),
    (["mesh.pipeline=2", "pipeline.schedule=interleaved_1f1b"],
     "pipeline.schedule=interleaved_1f1b needs pipeline.repeats >= 2 \\(each stage's blocks of layers\\); with one "
     "block it is pipeline.schedule=1f1b"),
    (["mesh.pipeline=2", "pipeline.schedule=interleaved_1f1b", "pipeline.repeats=4"],
     "model.num_layers=4 is not divisible by mesh.pipeline x pipeline.repeats = 8, the interleaved_1f1b schedule's"),
])
def test_refused_pairings_say_why(overrides, reason):
    cfg = config.load(None, tiny_overrides("unused") + MODEL + overrides)
    with pytest.raises(ConfigError, match=reason):
        trainer.build(cfg, jax.devices()[:2])

