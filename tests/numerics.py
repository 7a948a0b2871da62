"""Tolerances from the arithmetic, for two float32 computations of the same quantity that add their terms in
another order: a fused kernel, a blocked loop, a sharded reduction, an unrolled scan - or the same program on a
CPU with another vector width, which pairs a reduction's terms differently.

Each float32 addition rounds by at most half a unit in the last place (ulp) of its partial sum, so a reordered sum
of terms of magnitude s moves by a few EPS x s, whatever the sum's own value: an element that is a near-cancellation
(a gradient entry of 0.008 among entries of 5) carries the same absolute error as its neighbours, and a relative
tolerance on that element alone fails for no fault of the code, on one machine and not another. So the tolerance
here is `ulps x EPS x scale`, the same for every element of an array: `scale` is the magnitude of the terms summed
(by default the largest |element| of the expected array, the magnitude its sums produce) and `ulps` a count each
caller states with its reason: the error measured where the test was written, with room for another order.

What it still catches: any difference above ulps x EPS of the array's scale - 1.9e-6 of it at 16 ulps - while a
missing term, a term counted twice or a wrong factor moves an array by a visible fraction of its scale.
"""

from __future__ import annotations

import jax
import numpy as np

EPS = float(np.finfo(np.float32).eps)  # 2**-23 ~ 1.19e-7: float32's relative rounding step


def assert_close(actual, desired, ulps: float, scale: float | None = None, err_msg: str = "") -> None:
    """|actual - desired| <= ulps x EPS x scale element-wise; `scale` by default max |desired|."""
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    assert actual.shape == desired.shape, (actual.shape, desired.shape, err_msg)
    scale = float(np.abs(desired).max()) if scale is None else float(scale)
    np.testing.assert_allclose(actual, desired, rtol=0, atol=ulps * EPS * scale,
                               err_msg=f"{err_msg} (tolerance {ulps} float32 ulps of the scale {scale:.3g})".strip())


def assert_trees_close(actual, desired, ulps: float) -> None:
    """`assert_close` for every leaf of two pytrees, each leaf at its own scale (a weight's gradient and a gain's
    differ by orders of magnitude); the leaf's path in the message."""
    flat_actual = jax.tree_util.tree_flatten_with_path(actual)[0]
    flat_desired = jax.tree.leaves(desired)
    assert len(flat_actual) == len(flat_desired), (len(flat_actual), len(flat_desired))
    for (path, a), b in zip(flat_actual, flat_desired):
        assert_close(a, b, ulps, err_msg=jax.tree_util.keystr(path))
