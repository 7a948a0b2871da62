"""The held-out loss (train.eval_every_steps): the same first train.eval_batches global batches of the eval
split every time, so that evaluations are comparable across steps and a resumed run logs the same values.
They are read once and kept on the devices (a few MB): an evaluation waits for no input."""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

from scaletrain.data import loader as data_lib
from scaletrain.errors import DataError


class Evaluator:
    def __init__(self, cfg, setup):
        dataset = data_lib.make_eval_dataset(cfg)  # never None here: config.validate requires eval data
        whole = len(dataset) // cfg.train.global_batch
        if whole < 1:
            raise DataError(f"the eval split holds {len(dataset)} sequences of data.seq_len={cfg.data.seq_len}, "
                            f"fewer than one batch of train.global_batch={cfg.train.global_batch}")
        batches = min(cfg.train.eval_batches, whole)
        reader = data_lib.make_iterator(cfg, setup.batch_sharding, dataset, workers=0)
        try:
            self.batches = [setup.put_batch(next(reader)) for _ in range(batches)]
        finally:
            reader.close()
        t0 = time.perf_counter()
        self.step = setup.eval_step.lower(setup.abstract_state.params, setup.abstract_batch(),
                                          setup.abstract_state.reference).compile()
        if jax.process_index() == 0:
            if batches < cfg.train.eval_batches:
                print(f"warning: the eval split holds {whole} batches; train.eval_batches={cfg.train.eval_batches} "
                      f"reduced to {whole}", file=sys.stderr, flush=True)
            print(f"compiled the eval step in {time.perf_counter() - t0:.1f} s; {batches} batches "
                  f"({batches * cfg.train.global_batch * cfg.data.seq_len:,} tokens) per evaluation", flush=True)

    def __call__(self, state) -> jax.Array:
        """The mean loss over the eval batches' tokens (DPO's: pairs), as a replicated device scalar (read when
        logged)."""
        total = count = jnp.zeros((), jnp.float32)
        for batch in self.batches:
            loss_sum, tokens = self.step(state.params, batch, state.reference)
            total, count = total + loss_sum, count + tokens
        return total / jnp.maximum(count, 1.0)
