"""`generate`: continue a prompt with a run's checkpoint, one token at a time through a KV cache.

The prompt is run once (prefill), filling the cache; then each new token is one position through every layer
(Llama.decode), inside one jitted loop. Temperature 0 is greedy: each token is the argmax of the logits that
`logits` gives for the sequence so far.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scaletrain import inference
from scaletrain import model as model_lib
from scaletrain import tokenizer as tokenizer_lib
from scaletrain.errors import UserError


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


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_p"))
def generate_tokens(graphdef: nnx.GraphDef, params, prompt_t: jax.Array, key: jax.Array, eos_id: int | jax.Array,
                    max_new_tokens: int, temperature: float, top_p: float) -> tuple[jax.Array, jax.Array]:
    """(tokens [max_new_tokens], how many are real): the continuation of one prompt, ending at the first EOS
    (kept) or after max_new_tokens."""
    model = nnx.merge(graphdef, params)
    t = prompt_t.shape[0]
    cache = model.init_cache(1, t + max_new_tokens)
    logits_btv, cache = model.decode(prompt_t[None], jnp.int32(0), cache)

    def step(carry):
        i, logits_v, cache, key, out, _ = carry
        key, sub = jax.random.split(key)
        token = pick(logits_v, sub, temperature, top_p)
        logits_btv, cache = model.decode(token[None, None], t + i, cache)
        return i + 1, logits_btv[0, -1], cache, key, out.at[i].set(token), token == eos_id

    def more(carry):
        i, *_, done = carry
        return (i < max_new_tokens) & ~done

    out = jnp.zeros(max_new_tokens, jnp.int32)
    n, *_ = carry = jax.lax.while_loop(more, step, (jnp.int32(0), logits_btv[0, -1], cache, key, out, jnp.array(False)))
    return carry[4], n


def main(run_dir: str, step: int | None, prompt: str, max_new_tokens: int, temperature: float, top_p: float,
         seed: int) -> int:
    from scaletrain.checkpoint import restore_params

    cfg = inference.load_config(run_dir)
    tokenizer = tokenizer_lib.load(cfg.data.tokenizer)
    prompt_ids = tokenizer.encode(prompt)
    if tokenizer.bos_id is not None:
        prompt_ids = np.concatenate([[tokenizer.bos_id], prompt_ids])
    if len(prompt_ids) == 0:
        raise UserError("--prompt is empty and the tokenizer has no BOS token to start from; give some text")
    setup = inference.one_device_setup(cfg)
    step, params = restore_params(run_dir, setup.abstract_state.params, what="generate", step=step)
    graphdef = model_lib.abstract(setup.model_cfg)[0]
    tokens, n = generate_tokens(graphdef, params, jnp.asarray(prompt_ids, jnp.int32), jax.random.PRNGKey(seed),
                                tokenizer.eos_id, max_new_tokens, temperature, top_p)
    new = np.asarray(tokens)[: int(n)]
    print(prompt + tokenizer.decode(new[new != tokenizer.eos_id]), flush=True)
    return 0
