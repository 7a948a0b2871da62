"""The held-out loss (train.eval_every_steps): the same first train.eval_batches global batches of the eval
split every time, so that evaluations are comparable across steps and a resumed run logs the same values."""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

from scaletrain import data as data_lib
from scaletrain.errors import DataError


class Evaluator:
    def __init__(self, cfg, setup):
        dataset = data_lib.make_eval_dataset(cfg)
        if dataset is None:  # config.validate requires an eval source; this names what was found
            raise DataError("train.eval_every_steps needs held-out data: data.eval_path, or data.source=prepared "
                            "with an eval split (data prepare --eval-fraction)")
        whole = len(dataset) // cfg.train.global_batch
        if whole < 1:
            raise DataError(f"the eval split holds {len(dataset)} sequences of data.seq_len={cfg.data.seq_len}, "
                            f"fewer than one batch of train.global_batch={cfg.train.global_batch}")
        self.batches = min(cfg.train.eval_batches, whole)
        self.cfg, self.setup, self.dataset = cfg, setup, dataset
        t0 = time.perf_counter()
        self.step = setup.eval_step.lower(setup.abstract_state.params, setup.abstract_batch()).compile()
        if jax.process_index() == 0:
            if self.batches < cfg.train.eval_batches:
                print(f"warning: the eval split holds {whole} batches; train.eval_batches={cfg.train.eval_batches} "
                      f"reduced to {whole}", file=sys.stderr, flush=True)
            print(f"compiled the eval step in {time.perf_counter() - t0:.1f} s; {self.batches} batches "
                  f"({self.batches * cfg.train.global_batch * cfg.data.seq_len:,} tokens) per evaluation", flush=True)

    def __call__(self, params) -> jax.Array:
        """The mean loss over the eval batches' tokens, as a replicated device scalar (read when logged)."""
        batches = data_lib.make_iterator(self.cfg, self.setup.batch_sharding, self.dataset)
        total = count = jnp.zeros((), jnp.float32)
        for _ in range(self.batches):
            loss_sum, tokens = self.step(params, self.setup.put_batch(next(batches)))
            total, count = total + loss_sum, count + tokens
        return total / jnp.maximum(count, 1.0)
