"""The optimizer: AdamW with warmup + cosine decay, global-norm clipping and masked weight decay."""

from __future__ import annotations

from typing import Any

import jax
import optax

from scaletrain.sharding import is_logical


def schedule(optim_cfg, steps: int) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then cosine decay to peak * min_lr_ratio at `steps`."""
    warmup = min(optim_cfg.warmup_steps, steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=optim_cfg.learning_rate, warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1), end_value=optim_cfg.learning_rate * optim_cfg.min_lr_ratio)


def decay_mask(optim_cfg, logical: Any) -> Any:
    """True where weight decay applies, told by logical axes: norms hold only `embed` (per layer),
    embeddings and the output projection hold `vocab`."""

    def decays(names: tuple[str | None, ...]) -> bool:
        dims = tuple(n for n in names if n != "layers")
        if dims == ("embed",):
            return optim_cfg.decay_norms
        if "vocab" in dims:
            return optim_cfg.decay_embeddings
        return True

    return jax.tree.map(decays, logical, is_leaf=is_logical)


def make(optim_cfg, steps: int, logical: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
    lr = schedule(optim_cfg, steps)
    parts = []
    if optim_cfg.grad_clip_norm > 0:
        parts.append(optax.clip_by_global_norm(optim_cfg.grad_clip_norm))
    parts.append(optax.adamw(lr, b1=optim_cfg.b1, b2=optim_cfg.b2, eps=optim_cfg.eps,
                             weight_decay=optim_cfg.weight_decay, mask=decay_mask(optim_cfg, logical)))
    return optax.chain(*parts), lr
