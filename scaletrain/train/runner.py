"""The stack runner: how embed -> layer stack -> head -> loss runs for a config on a mesh - a plain scan over the
layers, or a pipeline over the `pipeline` mesh axis with one of the schedules (GPipe, circular, 1F1B, interleaved
1F1B, zero-bubble) - chosen once, here (`choose`, which layout.of keeps beside the state it lays out), from the
config and the mesh.

The model only gives its pieces: Llama.stack_inputs (the embedded stream, one layer's body, the stacked layer
weights in their canonical `[layers, ...]` layout, the per-row arrays every layer reads), final_stream and
loss.head_loss (final norm, output projection, loss). It never learns how it is pipelined, and the step only asks
the runner for the loss. A new schedule is taught here and in its own module (pipeline.py, pipeline_1f1b.py,
pipeline_zb.py).

Every runner returns the summed cross-entropy and the layer stack's auxiliary sums - each block's dict (a
router's statistics; empty for a dense block), stacked along the layers in canonical order and summed over the
batch's rows and the pipeline's microbatches - so that the step can add the model's penalty for them and log
them, whatever the schedule.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scaletrain.parallel import pipeline, pipeline_1f1b, pipeline_zb
from scaletrain.parallel.checks import microbatches
from scaletrain.train import objective as objective_lib
from scaletrain.train.loss import head_loss, token_losses

SCAN = "scan"
DROPOUT_SEEDS = "lora_seeds"  # the batch key of a training step's dropout seeds (lora.token_seeds)


@dataclasses.dataclass(frozen=True)
class Runner:
    schedule: str = SCAN  # scan, or a pipeline.schedule: gpipe | circular | 1f1b | interleaved_1f1b | zero_bubble
    stages: int = 1
    microbatches: int = 1  # the pipeline's (gradient accumulation's are the step's)
    repeats: int = 1  # circular, interleaved: blocks of layers per stage, the weights in pipeline.memory_order
    gather_once: bool = False  # 1f1b, interleaved, zero_bubble: pipeline.gather_weights=once
    keep_stage_inputs: bool = False  # 1f1b, interleaved: pipeline.keep=stage_inputs

    @property
    def fetches_layers(self) -> bool:
        """With parameters in host memory (params.offload), whether the runner brings each layer's weights to
        the device as it runs that layer (the plain scan: sharding.constrain_param). A pipeline instead takes its
        stage's weights whole, fetched before its loop: JAX cannot yet carry the gradient of a host-memory
        weight out of two nested loops (the iterations, a stage's layers) - it types the cotangent in the wrong
        memory space. Its devices then hold a stage's parameters and their gradients during the step, as
        without params.offload; the moments and the update stay in host memory."""
        return self.stages == 1

    @property
    def forms_gradients(self) -> bool:
        """Whether the runner forms the gradients itself, in its own loop, from each layer's vjp - its layer
        body unrematerialised, a remat policy unused: the 1F1B schedules and zero-bubble (pipeline_1f1b.py,
        pipeline_zb.py)."""
        return self.schedule in pipeline_1f1b.OWN_GRADIENTS

    @property
    def recomputes_every_layer(self) -> bool:
        """Whether the backward pass runs every layer's forward again whatever the remat policy - full remat's
        work, the policy unused: the 1F1B schedules keep each layer's input from the forward slot and take each
        layer's vjp in the backward slot, its residuals (every one: the layer unrematerialised) alive for that
        layer only (pipeline_1f1b.py)."""
        return self.schedule in pipeline_1f1b.SCHEDULES

    def remat_policy(self, policy: str) -> str:
        """The remat policy whose work the backward pass does, the config's being `policy`: full's under 1F1B
        (recomputes_every_layer), none's under zero-bubble (pipeline_zb.py keeps every layer's residuals)."""
        if self.schedule == pipeline_zb.SCHEDULE:
            return "none"
        return "full" if self.recomputes_every_layer else policy

    def reruns_stages(self, remat_policy: str) -> bool:
        """Whether the backward pass runs each stage's forward again from its kept input, on top of what its
        layers recompute: 1F1B keeping stage inputs (pipeline.keep), GPipe and circular under a remat policy
        (remat.around_stages)."""
        if self.forms_gradients:
            return self.keep_stage_inputs
        return self.stages > 1 and remat_policy != "none"

    def memory_order(self, layers: int) -> np.ndarray | None:
        """The canonical index of the layer at each position of the stacked weights as this runner keeps them
        in memory (pipeline.memory_order), or None where that is the canonical order: checkpoints keep the
        canonical one (trainer.Setup.to_disk, from_disk)."""
        return pipeline.memory_order(layers, self.stages, self.repeats) if self.repeats > 1 else None

    def sends(self) -> tuple[int, int]:
        """(Stage-to-stage sends per step, those the step waits for): the schedule's own count (pipeline.sends,
        pipeline_1f1b.sends, pipeline_zb.sends); none without stages."""
        if self.stages == 1:
            return 0, 0
        if self.schedule == pipeline_zb.SCHEDULE:
            return pipeline_zb.sends(self.stages, self.microbatches)
        of = pipeline_1f1b.sends if self.schedule in pipeline_1f1b.SCHEDULES else pipeline.sends
        return of(self.stages, self.microbatches, self.repeats)

    def loss(self, graphdef: nnx.GraphDef, params: Any, batch: Mapping[str, jax.Array],
             penalty: Callable[[dict], jax.Array],
             objective: objective_lib.Objective = objective_lib.NEXT_TOKEN) -> tuple[jax.Array, dict, dict]:
        """(The summed loss of `batch` - `objective`'s head over the final stream: the cross-entropy, or DPO's -,
        the layer stack's auxiliary sums [layers, ...] with those the model computes beside the head (Decoder.ahead:
        multi-token prediction's), the head's metric sums).

        `penalty(aux)` is what the caller's objective adds for the auxiliary sums, linear in them: the 1F1B
        schedule forms the gradients itself, inside its loop, so it pulls the penalty's through each stage there;
        the other runners leave it to the caller's differentiation."""
        model = nnx.merge(graphdef, params)
        rows = objective.rows(batch)
        if self.forms_gradients:
            x_btd, body, stacked, extras = model.stack_inputs(batch["tokens"], batch["positions"],
                                                              batch["segment_ids"], remat_layers=False)
            total, aux = self._one_f_one_b(graphdef, params, x_btd, body, stacked, extras, rows, penalty,
                                           objective, model.cfg.unroll_loops)
            return total, aux, {}  # the head's sums: none (checks.py refuses an objective with some here)
        x_btd, aux = self._stack(model, batch)
        total, sums = objective.head(graphdef, params, model.final_stream(x_btd), rows)
        return total, aux | model.ahead(graphdef, params, x_btd, batch, head_loss), sums

    def token_losses(self, graphdef: nnx.GraphDef, params: Any, batch: Mapping[str, jax.Array]) -> jax.Array:
        """Each position's cross-entropy [b, t] of `batch` - a forward pass alone, for DPO's reference. Through the
        plain scan or GPipe's schedule (a 1F1B runner's program returns summed losses: checks.py refuses DPO
        there)."""
        model = nnx.merge(graphdef, params)
        return token_losses(graphdef, params, model.final_stream(self._stack(model, batch)[0]), batch["targets"])

    def _stack(self, model, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, dict]:
        """The layer stack's output stream and auxiliary sums, through the plain scan or a GPipe schedule (with
        LoRA's dropout where a training step's batch carries its seeds: models/lora.py)."""
        units = model.cfg.stack_layers // model.unit_layers(model.cfg)
        x_btd, body, stacked, extras = model.stack_inputs(
            batch["tokens"], batch["positions"], batch["segment_ids"], dropout_seeds=batch.get(DROPOUT_SEEDS),
            layer_ids=self.memory_order(units))
        if self.stages > 1:
            return pipeline.gpipe(body, x_btd, stacked, extras, self.stages, self.microbatches, model.cfg.unroll_loops,
                                  model.cfg.remat, model.cfg.remat_custom, self.repeats)
        return pipeline.scan(body, x_btd, stacked, extras, model.cfg.unroll_loops)

    def _one_f_one_b(self, graphdef, params, x_btd, body, stacked, extras, rows, penalty, objective, unroll):
        """The layer stack as a 1F1B pipeline (interleaved: `repeats` blocks of layers per stage) or a
        zero-bubble one, which runs the head on each microbatch as it leaves the last stage."""
        def head(head_params, layers, x_btd, rows):
            p = {**head_params, "layers": nnx.to_pure_dict(layers)}
            return objective.head(graphdef, p, nnx.merge(graphdef, p).final_stream(x_btd), rows)[0]

        # The penalty's gradient with respect to each layer's sums (constant: it is linear in them).
        rows_per_microbatch = x_btd.shape[0] // self.microbatches
        aux_shape = jax.eval_shape(lambda: pipeline.scan(body, x_btd[:rows_per_microbatch], stacked,
                                                         tuple(e[:rows_per_microbatch] for e in extras))[1])
        # (A block's sums are a slice of these: the penalty's gradient is the same per layer.)
        aux_weights = jax.grad(penalty)(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux_shape))
        head_params = {k: v for k, v in params.items() if k != "layers"}
        return pipeline_1f1b.loss(body, head, self.stages, self.microbatches, self.repeats, self.gather_once,
                                  not self.keep_stage_inputs, self.schedule == pipeline_zb.SCHEDULE, unroll, x_btd,
                                  stacked, head_params, extras, rows, aux_weights)


def choose(cfg, axis_sizes: Mapping[str, int]) -> Runner:
    """The runner of config `cfg` on a mesh of these axis sizes (ICI x DCN): a plain scan without pipeline
    stages, else the pipeline.schedule the config names."""
    stages = axis_sizes["pipeline"]
    if stages == 1:
        return Runner()
    schedule = cfg.pipeline.schedule
    return Runner(schedule=schedule, stages=stages, microbatches=microbatches(cfg, axis_sizes),
                  repeats=cfg.pipeline.repeats if schedule in pipeline.BLOCKED else 1,
                  gather_once=schedule in pipeline_1f1b.OWN_GRADIENTS and cfg.pipeline.gather_weights == "once",
                  keep_stage_inputs=schedule in pipeline_1f1b.SCHEDULES and cfg.pipeline.keep == "stage_inputs")
