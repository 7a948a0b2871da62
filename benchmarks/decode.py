"""FlashNorm in decode: one norm + projection at decode shapes, end-to-end decode tokens/s, and the decode step
compiled ahead of time for a TPU, per model.norm mode.

    python benchmarks/decode.py norm [--batches 1,4,16,64] [--dtype float32] [--repeats 30]
    python benchmarks/decode.py e2e  [--batches 1,16] [--new-tokens 8] [--dtype float32] [--layers N]
    python benchmarks/decode.py aot  [--topology v5p:2x2x1] [--batches 1,16] [--cache 2048]

Variants, each the same function: `standard` RMSNorm with its gain, then the matmul (the unmodified model);
then, with the gains folded into the weights (`convert fold-norms`, model.norm_weights=folded), `standard` (a
weightless norm, then the matmul), `deferred` (x @ W* in XLA, rows scaled by 1/rms(x) afterwards) and `fused`
(one Pallas kernel: the decode-shaped one for these few rows).

`norm`: the latency of RMSNorm(x) @ W alone, forward only (decode has no backward), at Llama-3.2-1B and
Llama-3.1-8B widths (K = d_model; N = the fused Q/K/V width, and gate/up), median wall time of `--repeats` calls.
`e2e`: Llama-3.2-1B (configs/llama3_1b.yaml, random weights; `--layers` fewer of its 16 for a quick look),
greedy decoding of `--new-tokens` after a 16-token prompt, through `generate`'s jitted loop with weights in the
compute dtype; tokens/s = batch x new tokens / (the loop's time - the prompt's prefill alone).
`aot`: one decode step (batch B, one token, a KV cache of `--cache` positions) of Llama-3.2-1B and Llama-3.1-8B,
compiled for one chip of the topology through libtpu: XLA's FLOPs, bytes accessed and optimal_seconds (its
estimate of the time). XLA counts a loop's body once, so the step is composed from two compiles, neither with a
loop: one block alone, and the model with one layer (embedding, block, output projection); step = that +
(layers - 1) x block. (Unrolling the layer loop instead slices each layer's weights out of the stack, which
XLA copies before a Pallas call.) Pallas kernels count by their cost estimates (kernels/tiling.cost: each
operand once).

On a CPU the fused kernel runs in Pallas' interpreter, lowered to XLA loops: its CPU times measure the
interpreter, not a kernel. On a GPU (`make bench-gpu`) it is the Triton kernel. Results go in
docs/benchmarks.md and docs/flashnorm.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaletrain import runtime  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# (label, model.norm, folded gains)
VARIANTS = (("standard", "standard", False), ("standard-folded", "standard", True),
            ("deferred-folded", "deferred", True), ("fused-folded", "fused", True))
# (model, site): (K, N).
SHAPES = {("1B", "qkv"): (2048, (32 + 2 * 8) * 64), ("1B", "gate_up"): (2048, 2 * 8192),
          ("8B", "qkv"): (4096, (32 + 2 * 8) * 128), ("8B", "gate_up"): (4096, 2 * 14336)}
CONFIGS = {"1B": ROOT / "configs" / "llama3_1b.yaml", "8B": ROOT / "configs" / "llama3_8b.yaml"}
EPS = 1e-5
PROMPT = 16


def _median_seconds(fn, args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _header(what: str) -> None:
    import jax

    device = jax.devices()[0]
    print(f"## {time.strftime('%Y-%m-%d')}  {what} on {device.platform} ({device.device_kind}, "
          f"{jax.device_count()} device(s))\n", flush=True)


def norm(batches: list[int], dtype: str, repeats: int) -> None:
    import jax
    import jax.numpy as jnp

    from benchmarks.flashnorm import _norm_projection

    _header(f"RMSNorm + projection, forward, {dtype}, median of {repeats}")
    labels = [label for label, *_ in VARIANTS]
    print("| shape (K x N) | batch | " + " | ".join(f"{v} us" for v in labels) + " | deferred vs standard | "
          "fused vs standard |\n|---|---|" + "---|" * (len(labels) + 2))
    for (model, site), (k, n) in SHAPES.items():
        ks = jax.random.split(jax.random.PRNGKey(0), 3)
        g = (1 + 0.2 * jax.random.normal(ks[1], (k,))).astype(dtype)
        w = (0.02 * jax.random.normal(ks[2], (k, n))).astype(dtype)
        folded = (g.astype(jnp.float32)[:, None] * w.astype(jnp.float32)).astype(dtype)
        for b in batches:
            x = jax.random.normal(ks[0], (b, k)).astype(dtype)
            us = {}
            for label, mode, is_folded in VARIANTS:
                fn = jax.jit(_norm_projection(mode, weightless=is_folded))
                us[label] = 1e6 * _median_seconds(fn, (x, g, folded if is_folded else w), repeats)
            base = us["standard"]
            gains = [f"{100 * (base / us[v] - 1):+.1f}%" for v in ("deferred-folded", "fused-folded")]
            print(f"| {model} {site} ({k} x {n}) | {b} | " + " | ".join(f"{us[v]:.0f}" for v in labels) +
                  " | " + " | ".join(gains) + " |", flush=True)


def _model_config(model: str, overrides: list[str]):
    from scaletrain import config
    from scaletrain import models as model_lib

    cfg = config.load(CONFIGS[model], ["mesh.fsdp=1", *overrides])
    return model_lib.ModelConfig.from_config(cfg.model)


def e2e(batches: list[int], new_tokens: int, dtype: str, layers: int | None, variants: tuple) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from scaletrain import models as model_lib
    from scaletrain.tools import inference
    from scaletrain.tools.generate import compute_dtype_params, generate_tokens

    overrides = [f"model.dtype={dtype}"] + ([f"model.num_layers={layers}"] if layers else [])
    base = _model_config("1B", overrides)
    _header(f"Llama-3.2-1B{f' ({layers} of its 16 layers)' if layers else ''} greedy decode, {dtype}, "
            f"{PROMPT}-token prompt, {new_tokens} new tokens")
    params = model_lib.init_params(base, jax.random.PRNGKey(0))
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 64))
    params = jax.tree_util.tree_map_with_path(  # gains of a trained model: not all ones
        lambda p, a: 1 + 0.2 * jax.random.normal(next(keys), a.shape) if p[-1].key == "scale" else a, params)
    folded, reference = None, {}
    print("| variant | batch | tokens/s | ms per token | vs standard |\n|---|---|---|---|---|")
    for label, mode, is_folded in variants:
        if is_folded and folded is None:
            folded = jax.tree.map(jnp.asarray, inference.fold(params, base.tie_embeddings))
        cfg = dataclasses.replace(base, norm=mode, norm_weights="folded" if is_folded else "standard")
        graphdef = model_lib.abstract(cfg)[0]
        weights = compute_dtype_params(folded if is_folded else params, cfg.dtype)

        @jax.jit
        def prefill(weights, prompt):
            model = nnx.merge(graphdef, weights)
            return model.decode(prompt, jnp.int32(0), model.init_cache(prompt.shape[0], PROMPT + new_tokens))

        for b in batches:
            prompt = jax.random.randint(jax.random.PRNGKey(b), (b, PROMPT), 0, cfg.vocab_size)
            loop = _median_seconds(lambda w, p: generate_tokens(graphdef, w, p, jax.random.PRNGKey(0), -1,
                                                                new_tokens, 0.0, 1.0), (weights, prompt), 2)
            seconds = loop - _median_seconds(prefill, (weights, prompt), 2)
            tokens_s = b * new_tokens / seconds
            if label == "standard":
                reference[b] = tokens_s
            versus = f"{100 * (tokens_s / reference[b] - 1):+.1f}%" if b in reference else "-"
            print(f"| {label} | {b} | {tokens_s:.1f} | {1e3 * seconds / new_tokens:.1f} | {versus} |", flush=True)
        del weights


def aot(topology: str, batches: list[int], cache: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from scaletrain import models as model_lib
    from scaletrain.models import rope
    from scaletrain.models.transformer import Block
    from scaletrain.parallel.sharding import Rules, use_rules
    from scaletrain.planner import aot as aot_lib

    device = aot_lib.topology_devices(topology)[0]
    mesh = Mesh(np.array([device]), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec())

    def shaped(tree):  # bf16 weights (the serving dtype), float32 gains
        return jax.tree_util.tree_map_with_path(lambda p, a: jax.ShapeDtypeStruct(
            a.shape, jnp.float32 if p[-1].key == "scale" else jnp.bfloat16, sharding=sharding), tree)

    def compile_cost(fn, *args) -> dict:
        """XLA's counts for fn(weights, input, position, k_cache, v_cache), the caches donated (updated in place)."""
        with use_rules(mesh, Rules(params={}, grads={}, opt_state={}, activations={})):
            compiled = jax.jit(fn, donate_argnums=(3, 4)).lower(*args).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        return {"bytes": cost.get("bytes accessed", 0.0), "flops": cost.get("flops", 0.0),
                "seconds": cost.get("optimal_seconds", float("nan")),
                "kernels": compiled.as_text().count('custom_call_target="tpu_custom_call"')}

    print(f"## {time.strftime('%Y-%m-%d')}  one decode step on one chip of {topology} ({device.device_kind}), "
          f"ahead of time: bf16 weights, one token per sequence, a KV cache of {cache} positions\n")
    print("| model | batch | variant | block: Mosaic kernels | block GB | block us | step GFLOP | step GB | "
          "step ms | vs standard |\n|---|---|---|---|---|---|---|---|---|---|")
    for model, b in itertools.product(("1B", "8B"), batches):
        base_seconds = None
        for label, mode, is_folded in VARIANTS:
            full = dataclasses.replace(_model_config(model, ["model.dtype=bfloat16"]), norm=mode,
                                       norm_weights="folded" if is_folded else "standard")
            one = dataclasses.replace(full, num_layers=1)
            kv = jax.ShapeDtypeStruct((b, cache, full.num_kv_heads, full.head_dim), jnp.bfloat16, sharding=sharding)
            token = jax.ShapeDtypeStruct((b, 1), jnp.int32, sharding=sharding)
            position = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding)

            block_graphdef, block_state = nnx.split(nnx.eval_shape(lambda: Block(full, nnx.Rngs(0))))

            def block_step(weights, x_btd, position, k_cache, v_cache):
                positions = jnp.broadcast_to(position, x_btd.shape[:2])
                sin, cos = rope.sin_cos(positions, full.inverse_frequencies())
                return nnx.merge(block_graphdef, weights).decode(x_btd, sin, cos, position, (k_cache, v_cache))

            block = compile_cost(block_step, shaped(nnx.to_pure_dict(block_state)),
                                 jax.ShapeDtypeStruct((b, 1, full.d_model), jnp.bfloat16, sharding=sharding),
                                 position, kv, kv)
            graphdef, shapes, _ = model_lib.abstract(one)

            def model_step(weights, token_b1, position, k_cache, v_cache):
                return nnx.merge(graphdef, weights).decode(token_b1, position, (k_cache[None], v_cache[None]))

            with_one = compile_cost(model_step, shaped(shapes), token, position, kv, kv)
            # The embedding, one block and the output projection, plus the other layers' blocks: each layer's
            # weights read in place, as the model's layer loop (a scan: a dynamic slice per layer) reads them.
            step = {k: with_one[k] + (full.num_layers - 1) * block[k] for k in ("bytes", "flops", "seconds")}
            base_seconds = base_seconds or step["seconds"]
            print(f"| {model} | {b} | {label} | {block['kernels']} | {block['bytes'] / 1e9:.3f} | "
                  f"{block['seconds'] * 1e6:.0f} | {step['flops'] / 1e9:.1f} | {step['bytes'] / 1e9:.2f} | "
                  f"{step['seconds'] * 1e3:.3f} | {100 * (base_seconds / step['seconds'] - 1):+.1f}% |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("norm", "e2e", "aot"))
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default: 1,4,16,64 for norm, "
                   "1,16 otherwise)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the compute dtype of norm and e2e (XLA:CPU is slow in bfloat16)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--layers", type=int, default=None, help="e2e: fewer layers than Llama-3.2-1B's 16")
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--cache", type=int, default=2048, help="aot: KV cache positions")
    p.add_argument("--variants", default=",".join(v[0] for v in VARIANTS), help="e2e: which, comma-separated")
    args = p.parse_args()
    batches = [int(b) for b in (args.batches or ("1,4,16,64" if args.part == "norm" else "1,16")).split(",")]
    runtime.configure(None)
    if args.part == "norm":
        norm(batches, args.dtype, args.repeats)
    elif args.part == "e2e":
        chosen = args.variants.split(",")
        e2e(batches, args.new_tokens, args.dtype, args.layers, tuple(v for v in VARIANTS if v[0] in chosen))
    else:
        aot(args.topology, batches, args.cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
