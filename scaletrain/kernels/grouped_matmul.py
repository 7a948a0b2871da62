"""The experts' grouped matmul (models/mixtral/moe.py): rows sorted by expert, `group_sizes[e]` of them for expert
e, each multiplied by its expert's weight - XLA's jax.lax.ragged_dot, or megablox's Pallas kernels
(jax.experimental.pallas.ops.tpu.megablox: gmm, and tgmm for the weight's gradient; MaxText's experts run on
them). model.moe_matmul picks (docs/moe.md); `auto` takes megablox on a TPU and ragged_dot elsewhere.

Why megablox on a TPU: its input gradient reads the weight transposed inside the kernel (`transpose_rhs`), where
XLA:TPU's ragged dot lays out a transposed copy of each gathered expert for it. Under FSDP every layer gathers its
experts twice (the forward pass and the backward pass's recomputation) and each gathered weight is laid out once
for either kernel; with ragged_dot the backward pass lays each out once more, transposed. DeepSeek-V3 671B on a v5p-512
(FSDP 256, 3 dense + 2 mixture layers compiled ahead of time): 1,006 GB moved a chip and step by XLA's count with
ragged_dot, 969 with megablox, MaxText 898; XLA's step 0.619 s, 0.603 s, MaxText 0.591 s (docs/benchmarks.md).
Off a TPU the kernels run interpreted: slow, for tests only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from scaletrain.errors import ConfigError

# Row, contraction and output tiles (MaxText's default tile sizes for its megablox experts: 512 x 1024 x 1024).
_TILES = (512, 1024, 1024)
# The TPU's sublanes: a row tile must hold whole (8, 128) tiles.
_SUBLANES = 8


def kind(choice: str, platform: str) -> str:
    """model.moe_matmul resolved for a device platform: `auto` is megablox on a TPU, ragged_dot elsewhere."""
    if choice == "auto":
        return "megablox" if platform == "tpu" else "ragged_dot"
    return choice


def _row_tile(rows: int, platform: str) -> int | None:
    """megablox's row tile for `rows` rows: the largest divisor of rows up to 512 (the kernel takes whole tiles),
    or None where a TPU cannot tile them (a divisor that is not a multiple of 8)."""
    tile = math.gcd(rows, _TILES[0])
    return None if platform == "tpu" and tile % _SUBLANES else tile


def megablox(x: jax.Array, w: jax.Array, group_sizes: jax.Array, platform: str) -> jax.Array:
    """jax.lax.ragged_dot(x [M, K], w [G, K, N], group_sizes) in x's dtype, by megablox's kernels (interpreted off a
    TPU), for the rows in the groups. The kernels leave rows past the groups unwritten, in the product and in x's
    gradient (ragged_dot makes them zeros): expert parallelism's receive buffer has such rows, and nothing reads
    them - the exchange takes back only the groups' rows, the weights' gradients sum only theirs, and the experts'
    biases give them none (unit.rows_of_groups). Masking them would cost the buffer's size again in memory
    (GPT-OSS-120B: +6 GiB a chip)."""
    m, k = x.shape
    tile = _row_tile(m, platform)
    if tile is None:
        raise ConfigError(f"megablox's grouped matmul (model.moe_matmul, auto on a TPU) needs each device's routed "
                          f"rows ({m}) to be a multiple of {_SUBLANES}; choose a batch or sequence length that makes "
                          "them so, or model.moe_matmul=ragged_dot")
    from jax.experimental.pallas.ops.tpu.megablox import ops

    tiling = (tile, min(_TILES[1], k), min(_TILES[2], w.shape[-1]))
    return ops.gmm(x, w.astype(x.dtype), group_sizes.astype(jnp.int32), x.dtype, tiling,
                   interpret=platform != "tpu")
