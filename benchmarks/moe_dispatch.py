"""A mixture-of-experts block as XLA's TPU cost model sees it: Mixtral 8x7B's block (router, dropless dispatch,
grouped SwiGLU, weighted combine) on one v5p chip's tokens in the FSDP layout (8 x 4096 tokens, every expert's
weights gathered), forward and backward, compiled ahead of time through libtpu (no TPU needed). Prints XLA's
FLOPs, bytes and optimal_seconds for:
- `model`: the block as scaletrain runs it (models/mixtral/moe.py: assignments choice-major, [k, T, d]);
- `token-major`: the same with the assignments token-major ([T, k, d]), as before the change to choice-major;
- `megablox`: the model's block with JAX's Pallas grouped matmul (megablox `gmm`, MaxText's kernel) in place of
  `jax.lax.ragged_dot`;
- `one expert`: every row through expert 0 as one plain matmul each (XLA fuses the SwiGLU's elementwise work
  into them): the floor a grouped kernel, which XLA cannot fuse into, is measured against.
The figures docs/moe.md quotes.

    python benchmarks/moe_dispatch.py [--only model,token-major]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The scoped-VMEM limit of MaxText's Mixtral recipe (benchmarks/vs_maxtext_tpu.py), for every variant.
os.environ.setdefault("LIBTPU_INIT_ARGS", "--xla_tpu_scoped_vmem_limit_kib=81920")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from scaletrain.models.mixtral import moe  # noqa: E402

B, S, D, F, E, K = 8, 4096, 4096, 14336, 8, 2  # one chip's sequences, Mixtral 8x7B's widths, experts, top-k
T = B * S
BF16 = jnp.bfloat16


def model(h, router, wg, wu, wd):
    return moe._per_device(K, 0.0, (), (), True, None)(h, router, wg, wu, wd)[0]


def token_major(h, router, wg, wu, wd):
    """The block with the assignments in token order ([T, k, d], k minor), as moe.py had it."""
    top_e, weights, _, _ = moe.route(h.reshape(T, D), router, K)
    order = jnp.argsort(top_e.reshape(-1), stable=True)
    rows = h.reshape(T, D)[order // K]
    out = moe._GroupedMatmul(None, (), ()).swiglu(rows, jnp.bincount(top_e.reshape(-1), length=E), (wg, wu, wd))
    out = jnp.zeros_like(out).at[order].set(out).reshape(T, K, D)
    return jnp.einsum("tkd,tk->td", out, weights.astype(h.dtype))


def megablox_swiglu(self, rows, group_sizes, experts):
    def matmul(x, w):  # MaxText's default tiles, clipped to the operands
        tiling = (min(512, x.shape[0]), min(1024, x.shape[1]), min(1024, w.shape[2]))
        return megablox.gmm(x, w, group_sizes.astype(jnp.int32), BF16, tiling)

    return moe._swiglu(rows, *experts, matmul)


def one_expert_swiglu(self, rows, group_sizes, experts):
    return moe._swiglu(rows, *(w[0] for w in experts), lambda x, w: x @ w)


VARIANTS = {"model": (model, None), "token-major": (token_major, None), "megablox": (model, megablox_swiglu),
            "one expert": (model, one_expert_swiglu)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated variants: " + ", ".join(VARIANTS))
    args = parser.parse_args()
    device = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices[0]
    place = SingleDeviceSharding(device)
    shapes = [jax.ShapeDtypeStruct(s, dt, sharding=place) for s, dt in (
        ((B, S, D), BF16), ((D, E), jnp.float32), ((E, D, F), BF16), ((E, D, F), BF16), ((E, F, D), BF16))]
    print(f"Mixtral 8x7B's MoE block, {T} tokens, forward + backward, one v5p chip (XLA's estimate)\n")
    print("| variant | XLA TFLOP | XLA GB | XLA ms |\n|---|---|---|---|")
    grouped = moe._GroupedMatmul.swiglu
    for name in (args.only.split(",") if args.only else VARIANTS):
        block, swiglu = VARIANTS[name]
        moe._GroupedMatmul.swiglu = swiglu or grouped
        try:
            loss = lambda *a, block=block: jnp.sum(block(*a).astype(jnp.float32) ** 2)  # noqa: E731
            compiled = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4))).lower(*shapes).compile()
        finally:
            moe._GroupedMatmul.swiglu = grouped
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        print(f"| {name} | {cost['flops'] / 1e12:.2f} | {cost['bytes accessed'] / 1e9:.2f} | "
              f"{cost['optimal_seconds'] * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
