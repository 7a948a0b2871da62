"""`generate`: continue a prompt with a run's checkpoint, one token at a time through a KV cache.

The prompt is run once (prefill), filling the cache; then each new token is one position through every layer
(Llama.decode), inside one jitted loop, for one or many prompts at once. Temperature 0 is greedy: each token is
the argmax of the logits that `logits` gives for the sequence so far. model.norm (standard, deferred, fused) and
folded weights (model.norm_weights) serve decoding as they serve training: the same function, computed three
ways (docs/flashnorm.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scaletrain import models as model_lib
from scaletrain.data import tokenizer as tokenizer_lib
from scaletrain.errors import UserError
from scaletrain.tools import inference


def pick(logits_v: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """The next token from float32 logits [vocab]: the argmax at temperature 0; otherwise a sample of
    softmax(logits / temperature) restricted to the smallest set of tokens whose probabilities sum to top_p."""
    if temperature == 0:
        return jnp.argmax(logits_v).astype(jnp.int32)
    scaled = logits_v / temperature
    if top_p < 1:
        order = jnp.argsort(-scaled)
        probs = jax.nn.softmax(scaled[order])
        # A token stays if the tokens more likely than it sum to less than top_p: the most likely always does.
        keep_sorted = jnp.cumsum(probs) - probs < top_p
        keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
        scaled = jnp.where(keep, scaled, -jnp.inf)
    return jax.random.categorical(key, scaled).astype(jnp.int32)


def compute_dtype_params(params: dict, dtype) -> dict:
    """`params` with every weight but the norms' gains in the compute dtype. The model casts each weight to it
    at every use (training keeps float32 masters); decoding one token at a time would cast every weight once
    per token, so the decode loop takes them cast once. Norm gains stay float32, as the norms compute in it."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a: a if path[-1].key == "scale" else a.astype(dtype), params)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_p"))
def generate_tokens(graphdef: nnx.GraphDef, params, prompt_bt: jax.Array, key: jax.Array, eos_id: int | jax.Array,
                    max_new_tokens: int, temperature: float, top_p: float) -> tuple[jax.Array, jax.Array]:
    """(tokens [batch, max_new_tokens], how many of each row are real): the continuations of prompts of one
    length, one per row, each ending at its first EOS (kept) or after max_new_tokens. The loop stops when every
    row has ended; a row that ended early keeps decoding, and its tokens past the EOS are not counted."""
    model = nnx.merge(graphdef, params)
    b, t = prompt_bt.shape
    cache = model.init_cache(b, t + max_new_tokens)
    logits_btv, cache = model.decode(prompt_bt, jnp.int32(0), cache)
    pick_rows = jax.vmap(pick, (0, 0, None, None))

    def step(carry):
        i, logits_bv, cache, key, out, done = carry
        key, sub = jax.random.split(key)
        token_b = pick_rows(logits_bv, jax.random.split(sub, b), temperature, top_p)
        logits_btv, cache = model.decode(token_b[:, None], t + i, cache)
        return i + 1, logits_btv[:, -1], cache, key, out.at[:, i].set(token_b), done | (token_b == eos_id)

    def more(carry):
        i, *_, done = carry
        return (i < max_new_tokens) & ~done.all()

    out = jnp.zeros((b, max_new_tokens), jnp.int32)
    n, _, _, _, out, _ = jax.lax.while_loop(more, step, (jnp.int32(0), logits_btv[:, -1], cache, key, out,
                                                         jnp.zeros(b, bool)))
    is_eos = (out == eos_id) & (jnp.arange(max_new_tokens) < n)
    return out, jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1) + 1, n)


def main(run_dir: str, step: int | None, prompt: str, max_new_tokens: int, temperature: float, top_p: float,
         seed: int, overrides: list[str] = ()) -> int:
    """The `generate` command; `overrides` change how the model computes (model.norm, model.dtype), not its
    shapes."""
    from scaletrain.train import init_from

    cfg = inference.load_config(run_dir, overrides)
    tokenizer = tokenizer_lib.load(cfg.data.tokenizer)
    prompt_ids = tokenizer.encode(prompt)
    if tokenizer.bos_id is not None:
        prompt_ids = np.concatenate([[tokenizer.bos_id], prompt_ids])
    if len(prompt_ids) == 0:
        raise UserError("--prompt is empty and the tokenizer has no BOS token to start from; give some text")
    setup = inference.one_device_setup(cfg)
    step, params = init_from.restore_run_params(run_dir, setup, "generate", step)
    graphdef = model_lib.abstract(setup.model_cfg)[0]
    tokens, n = generate_tokens(graphdef, compute_dtype_params(params, setup.model_cfg.dtype),
                                jnp.asarray(prompt_ids, jnp.int32)[None], jax.random.PRNGKey(seed),
                                tokenizer.eos_id, max_new_tokens, temperature, top_p)
    new = np.asarray(tokens)[0, : int(n[0])]
    print(prompt + tokenizer.decode(new[new != tokenizer.eos_id]), flush=True)
    return 0
