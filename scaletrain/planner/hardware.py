"""Peak throughput of the machine a run is on: the chip table (hardware.yaml), or a measured CPU peak."""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from pathlib import Path
from typing import Sequence

import yaml

_TABLE = Path(__file__).with_name("hardware.yaml")
_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "scaletrain" / "cpu_peak.json"


@functools.cache
def table() -> dict[str, dict]:
    return yaml.safe_load(_TABLE.read_text())


def chip(device_kind: str) -> str | None:
    """The table entry whose device_kinds best (longest) match a jax device_kind, e.g. 'TPU v5 lite' -> v5e."""
    matches = [(len(k), name) for name, spec in table().items() for k in spec["device_kinds"] if k in device_kind]
    return max(matches)[1] if matches else None


def measure_cpu_peak(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a large float32 matmul on the host CPU: the honest peak for CPU runs, which all simulated
    devices share."""
    import jax
    import jax.numpy as jnp

    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), cpu)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def cpu_peak() -> float:
    """Measured once per machine (CPU model and core count) and cached."""
    key = f"{platform.processor() or platform.machine()}/{os.cpu_count()}"
    try:
        cached = json.loads(_CACHE.read_text())
    except (OSError, ValueError):
        cached = {}
    if key not in cached:
        cached[key] = measure_cpu_peak()
        try:
            _CACHE.parent.mkdir(parents=True, exist_ok=True)
            _CACHE.write_text(json.dumps(cached))
        except OSError:
            pass  # an unwritable cache only costs a re-measurement next time
    return cached[key]


def peak_flops(devices: Sequence, per_device_override: float | None = None) -> float | None:
    """Peak FLOP/s of all `devices` together, or None when unknown."""
    if per_device_override:
        return per_device_override * len(devices)
    kind = devices[0].device_kind
    if devices[0].platform == "cpu":
        return cpu_peak() * len({d.process_index for d in devices})  # one host's peak per process
    name = chip(kind)
    return table()[name]["bf16_flops"] * len(devices) if name else None
