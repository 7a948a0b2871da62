"""FlashNorm: standard vs deferred vs fused RMSNorm + projection, by correctness, XLA op counts, ahead-of-time
TPU compiles and, on a GPU, timings.

    python benchmarks/flashnorm.py ops  [--topology v5p:2x2x1]
    python benchmarks/flashnorm.py step [--config configs/llama3_8b.yaml] [--topology v5p:4x4x2] [--set K=V]...
    python benchmarks/flashnorm.py gpu  [--repeats 20]

`ops`: one norm + projection (forward and backward) at Llama-3-8B and 70B shapes (8192 tokens per device; Q/K/V
and gate/up), first on the CPU against the jnp reference (a smaller M, the kernels interpreted), then compiled
for one chip of the topology: XLA's op counts, FLOPs, bytes accessed, optimal_seconds and temporaries.
`step`: the real train step compiled for the topology with each model.norm (planner/aot.py): HBM per device and
XLA's loop-corrected counts and optimal_seconds (the raw one beside it).
`gpu`: on a machine with a GPU, the Triton kernels' forward + backward at the `ops` shapes, timed against the
standard and deferred forms XLA compiles (median wall time, bf16). Without one, `optimal_seconds` (XLA's
estimate) is all there is. Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaletrain import runtime  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODES = ("standard", "deferred", "fused")
# (model, site): (K, N) - d_model, and the projection's output width.
SHAPES = {("8B", "qkv"): (4096, (32 + 2 * 8) * 128), ("8B", "gate_up"): (4096, 2 * 14336),
          ("70B", "qkv"): (8192, (64 + 2 * 8) * 128), ("70B", "gate_up"): (8192, 2 * 28672)}
TOKENS = 8192
EPS = 1e-5


def _norm_projection(mode: str, weightless: bool = False):
    """(x, g, w) -> RMSNorm(x) @ w, the way model.norm=mode computes it; `weightless`: w has the gain folded
    in (model.norm_weights=folded), and g is not used."""
    from scaletrain.models.layers import RMSNorm

    def fn(x, g, w):
        norm = RMSNorm(x.shape[-1], EPS, g.dtype, mode, weightless)
        if not weightless:
            norm.scale.value = g
        return norm.project(x[None], w, ("embed", "mlp"))[0]

    return fn


def _train_fn(fn):
    import jax

    def step(x, g, w, dz):
        z, vjp = jax.vjp(fn, x, g, w)
        return (z, *vjp(dz))

    return step


def ops(topology: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from scaletrain.kernels import norm_matmul as nm
    from scaletrain.parallel.sharding import Rules, use_rules

    print("## CPU: relative error against the jnp reference (fp32, M=64, forward and dx, dg, dW)\n")
    print("| shape | mode | z | dx | dg | dW |\n|---|---|---|---|---|---|")
    for (model, site), (k, n) in SHAPES.items():
        if model != "8B":
            continue
        ks = jax.random.split(jax.random.PRNGKey(0), 4)
        x, dz = jax.random.normal(ks[0], (64, k)), jax.random.normal(ks[3], (64, n))
        g, w = 1 + 0.2 * jax.random.normal(ks[1], (k,)), 0.02 * jax.random.normal(ks[2], (k, n))
        want = _train_fn(lambda x, g, w: nm.reference(x, g, w, EPS))(x, g, w, dz)
        # The interpreter runs grid steps one by one: large blocks keep it quick.
        interpreted = nm.Blocks(m=64, n=1024, k=2048, compiled=False)
        fns = {mode: _norm_projection(mode) for mode in MODES[:2]}
        fns["fused"] = lambda x, g, w: nm.norm_matmul(x, g, w, EPS, blocks=interpreted)
        fns["fused (Triton)"] = lambda x, g, w: nm.norm_matmul(x, g, w, EPS, blocks=nm.GpuBlocks(compiled=False))
        for mode, fn in fns.items():
            got = jax.jit(_train_fn(fn))(x, g, w, dz)
            errs = [float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(got, want)]
            print(f"| {model} {site} | {mode} | " + " | ".join(f"{e:.1e}" for e in errs) + " |", flush=True)

    device = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0]
    sharding = NamedSharding(Mesh(np.array([device]), ("d",)), PartitionSpec())
    print(f"\n## {topology}, one chip, ahead of time: forward + backward, bf16, M={TOKENS}\n")
    print("| shape | mode | fusions | dots | reduces | Mosaic kernels | GFLOP | GB accessed | temporaries MiB | "
          "optimal_seconds ms |\n|---|---|---|---|---|---|---|---|---|---|")
    for (model, site), (k, n) in SHAPES.items():
        shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in ((TOKENS, k), (k,), (k, n),
                                                                                     (TOKENS, n))]
        for mode in MODES:
            fn = _norm_projection(mode)
            # Under the chip's mesh, so that the fused kernels are built (blocks, Mosaic) for that chip.
            with use_rules(sharding.mesh, Rules(params={}, grads={}, opt_state={}, activations={})):
                compiled = jax.jit(_train_fn(fn)).lower(*shapes).compile()
            text = compiled.as_text()
            counts = collections.Counter(re.findall(r"= \S+ (fusion|dot|convolution|reduce|custom-call)\(", text))
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            mem = compiled.memory_analysis()
            print(f"| {model} {site} | {mode} | {counts['fusion']} | {counts['dot'] + counts['convolution']} | "
                  f"{counts['reduce']} | {text.count('tpu_custom_call')} | {cost.get('flops', 0) / 1e9:.0f} | "
                  f"{cost.get('bytes accessed', 0) / 1e9:.2f} | {mem.temp_size_in_bytes / 2**20:.0f} | "
                  f"{cost.get('optimal_seconds', float('nan')) * 1e3:.2f} |", flush=True)


def step(config_path: str, topology: str, overrides: list[str]) -> None:
    from scaletrain import config
    from scaletrain.facts import fit
    from scaletrain.planner import aot

    print(f"## {time.strftime('%Y-%m-%d')}  {config_path} on {topology}  {' '.join(overrides)}\n")
    print("| model.norm | HBM per device GiB | XLA TFLOP | XLA GB accessed | XLA optimal_seconds | raw optimal_seconds "
          "| compile s |\n|---|---|---|---|---|---|---|")
    for mode in MODES:
        r = aot.compile_step(config.load(config_path, [f"model.norm={mode}", *overrides]), topology)
        if r["memory"] is None:  # a does-not-fit result
            print(f"| {mode} | does not fit: {r['error'][:160]} ||||||", flush=True)
            continue
        estimate = "-" if r["xla_optimal_seconds"] is None else f"{r['xla_optimal_seconds']:.3f}"
        print(f"| {mode} | {r['hbm_per_device_bytes'] / fit.GIB:.2f} | {r['xla_flops'] / 1e12:.0f} | "
              f"{r['xla_bytes_accessed'] / 1e9:.0f} | {estimate} | {r['xla_raw']['optimal_seconds']:.3f} | "
              f"{r['compile_seconds']:.0f} |", flush=True)


def gpu(repeats: int) -> None:
    import statistics

    import jax
    import jax.numpy as jnp
    import numpy as np

    from scaletrain.kernels import norm_matmul as nm

    device = jax.devices()[0]
    if device.platform != "gpu":
        print(f"error: `gpu` times the Triton kernels on a GPU; this machine's first device is a "
              f"{device.platform} ({device.device_kind}). Expected a machine with an NVIDIA GPU.", file=sys.stderr)
        sys.exit(2)
    print(f"## {time.strftime('%Y-%m-%d')}  {device.device_kind}: forward + backward, bf16, M={TOKENS}, "
          f"median of {repeats}\n")
    print("| shape | mode | ms | TFLOP/s | worst relative error vs reference |\n|---|---|---|---|---|")
    for (model, site), (k, n) in SHAPES.items():
        ks = jax.random.split(jax.random.PRNGKey(0), 4)
        x, dz = (jax.random.normal(kk, s, jnp.bfloat16) for kk, s in ((ks[0], (TOKENS, k)), (ks[3], (TOKENS, n))))
        g = (1 + 0.2 * jax.random.normal(ks[1], (k,))).astype(jnp.bfloat16)
        w = (0.02 * jax.random.normal(ks[2], (k, n))).astype(jnp.bfloat16)
        want = jax.jit(_train_fn(lambda x, g, w: nm.reference(x, g, w, EPS)))(x, g, w, dz)
        for mode in MODES:
            fn = jax.jit(_train_fn(_norm_projection(mode)))
            got = jax.block_until_ready(fn(x, g, w, dz))
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(x, g, w, dz))
                times.append(time.perf_counter() - t0)
            seconds = statistics.median(times)
            err = max(float(np.linalg.norm(np.asarray(a, np.float32) - np.asarray(b, np.float32))
                            / np.linalg.norm(np.asarray(b, np.float32))) for a, b in zip(got, want))
            # forward, dx and dW: three matmuls of 2 M K N each.
            print(f"| {model} {site} | {mode} | {seconds * 1e3:.2f} | {3 * 2 * TOKENS * k * n / seconds / 1e12:.0f} | "
                  f"{err:.1e} |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("ops", "step", "gpu"))
    p.add_argument("--config", default=str(ROOT / "configs" / "llama3_8b.yaml"))
    p.add_argument("--topology", default=None, help="default: v5p:2x2x1 for ops, v5p:4x4x2 for step")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    runtime.configure(None)
    if args.part == "gpu":
        gpu(args.repeats)
    elif args.part == "ops":
        ops(args.topology or "v5p:2x2x1")
    else:
        step(args.config, args.topology or "v5p:4x4x2", args.set)
    return 0


if __name__ == "__main__":
    sys.exit(main())
