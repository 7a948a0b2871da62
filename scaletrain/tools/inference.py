"""Using a run's checkpoint outside training: `logits` (a forward pass) and `convert fold-norms` (FlashNorm's
weightless normalisation: each RMSNorm gain folded into the weights that follow it, docs/flashnorm.md).

Both load the run's own config (RUN_DIR/config.yaml) on one device, whatever mesh trained it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain import config as config_lib
from scaletrain.errors import UserError
from scaletrain.store import storage

# Norm -> the weights its output feeds in a block, each with its number of output dims (those after the input
# dim d that the gain scales); the final norm feeds lm_head. A mixture of experts' router and experts all take
# norm(x): its mlp_norm feeds all three (a dense MLP has no router).
FOLDS = {"attn_norm": (("attn", "wq", 2), ("attn", "wk", 2), ("attn", "wv", 2)),
         "mlp_norm": (("mlp", "router", 1), ("mlp", "w_gate", 1), ("mlp", "w_up", 1))}


def load_config(run_dir: str | Path, overrides: list[str] = (), one_device: bool = True):
    """The run's config with `overrides`; with `one_device`, its mesh reduced to one device (the mesh the run
    trained on need not exist here)."""
    path = storage.path(run_dir) / "config.yaml"
    if not path.is_file():
        raise UserError(f"'{run_dir}' is not a run directory: it has no config.yaml")
    mesh = [f"mesh.{p}{a}=1" for p in ("", "dcn_") for a in config_lib.MESH_AXES] if one_device else []
    cfg = config_lib.load(path, mesh + list(overrides))
    cfg.data.tokenizer = storage.resolve(cfg.data.tokenizer, run_dir)  # kept in the run: tokenizer/
    return cfg


def one_device_setup(cfg):
    """The run's objects (trainer.build) on this machine's first device."""
    from scaletrain.train import trainer

    return trainer.build(cfg, jax.devices()[:1])


def fold(params: Any, tie_embeddings: bool) -> Any:
    """Parameters with every foldable RMSNorm gain multiplied into the rows of the weights it feeds, in
    float32, then cast back: W*[d, ...] = g[d] W[d, ...]. The gains are removed (weightless norms); with tied
    embeddings the final norm keeps its gain (the table also embeds the input)."""
    def scaled(w, g, out_dims=1):
        # g [stack..., d] against w [stack..., d, out...], or against an expert's w [stack..., experts, d, out...]:
        # every expert takes the same gain.
        g = np.asarray(g, np.float32)
        between = w.ndim - out_dims - g.ndim
        g = g.reshape(*g.shape[:-1], *(1,) * between, g.shape[-1], *(1,) * out_dims)
        return (np.asarray(w, np.float32) * g).astype(w.dtype)

    def fold_blocks(layers):  # params["layers"]: a block, or a group of them (dense and moe: model.moe_every > 1)
        if "attn_norm" not in layers:
            return {name: fold_blocks(block) for name, block in layers.items()}
        block = dict(layers)
        for norm, targets in FOLDS.items():
            g = block.pop(norm)["scale"]
            for module, name, out_dims in targets:
                if name in block[module]:
                    block[module] = {**block[module], name: scaled(block[module][name], g, out_dims)}
        return block

    params = jax.tree.map(np.asarray, params)
    out = {**params, "layers": fold_blocks(params["layers"])}
    if not tie_embeddings:
        out["lm_head"] = scaled(params["lm_head"], params["final_norm"]["scale"])
        out.pop("final_norm")
    return out


def fold_norms(run_dir: str, out_dir: str) -> int:
    """`convert fold-norms`: OUT_DIR gets the newest checkpoint of RUN_DIR with its gains folded, as a run
    directory with model.norm_weights=folded (same step; fresh Adam moments and data position - the folded
    weights are different parameters to an optimizer). OUT_DIR is new or empty: the command line checks it."""
    from scaletrain.data import loader as data_lib
    from scaletrain.store.checkpoint import Checkpointer, restore_params
    from scaletrain.train.trainer import checkpoint_metadata

    cfg = load_config(run_dir)
    if cfg.model.norm_weights != "standard":
        raise UserError(f"'{run_dir}' already has model.norm_weights={cfg.model.norm_weights}: nothing to fold")
    out = storage.path(out_dir)
    source = one_device_setup(cfg)
    step, params = restore_params(run_dir, source.abstract_state.params, what="convert fold-norms")
    folded_overrides = ["model.norm_weights=folded", f"run_dir={out}"]
    folded_cfg = load_config(run_dir, folded_overrides)
    target = one_device_setup(folded_cfg)
    state = target.init(jax.random.PRNGKey(folded_cfg.seed))
    folded = jax.device_put(fold(params, cfg.model.tie_embeddings), target.state_shardings.params)
    state = state.replace(params=folded, step=jnp.asarray(step, jnp.int32))
    storage.prepare(out_dir)
    # The run's own mesh, so that training the folded model goes on where the original trained.
    (out / "config.yaml").write_text(config_lib.to_yaml(load_config(run_dir, folded_overrides, one_device=False)))
    ckpt = Checkpointer(out / "checkpoints", folded_cfg.checkpoint.max_to_keep, async_save=False)
    iterator = data_lib.make_iterator(folded_cfg, target.batch_sharding)
    ckpt.save(step, state, iterator.get_state(), checkpoint_metadata(target))
    ckpt.wait()
    ckpt.close()
    print(f"folded the RMSNorm gains of {run_dir} (step {step}) into {out}")
    return 0


def read_tokens(path: str, vocab_size: int) -> np.ndarray:
    try:
        tokens = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UserError(f"--tokens {path}: cannot read a .npy array ({e})") from None
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise UserError(f"--tokens {path}: expected integer token ids [batch, seq], got {tokens.dtype} "
                        f"{list(tokens.shape)}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise UserError(f"--tokens {path}: ids must lie in [0, {vocab_size}) (model.vocab_size), got "
                        f"[{tokens.min()}, {tokens.max()}]")
    return tokens.astype(np.int32)


def logits(run_dir: str, step: int | None, tokens_path: str, out_path: str, overrides: list[str] = ()) -> int:
    """`logits`: float32 logits [batch, seq, vocab] of each token sequence (one document per row); `overrides`
    change how the model computes (model.norm, model.dtype), not its shapes."""
    from flax import nnx

    from scaletrain import models as model_lib
    from scaletrain.train import init_from

    cfg = load_config(run_dir, overrides)
    tokens = read_tokens(tokens_path, cfg.model.vocab_size)
    setup = one_device_setup(cfg)
    step, params = init_from.restore_run_params(run_dir, setup, "logits", step)
    graphdef = model_lib.abstract(setup.model_cfg)[0]

    @jax.jit
    def forward(params, tokens_bt):
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1], dtype=jnp.int32), tokens_bt.shape)
        return nnx.merge(graphdef, params)(tokens_bt, positions, jnp.ones_like(tokens_bt))

    _save_whole(out_path, np.asarray(forward(params, tokens), np.float32))
    print(f"logits {list(tokens.shape) + [cfg.model.vocab_size]} of step {step} -> {out_path}")
    return 0


def _save_whole(path: str, array: np.ndarray) -> None:
    """np.save, written beside `path` and renamed onto it: an interrupted write leaves no half a file there."""
    partial = Path(f"{path}.partial")
    try:
        with partial.open("wb") as f:
            np.save(f, array)
        partial.rename(path)
    finally:
        partial.unlink(missing_ok=True)
