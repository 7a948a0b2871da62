"""What must happen before JAX initialises: the platform choice and the simulated CPU device count."""

from __future__ import annotations

import glob
import os


def has_accelerator() -> bool:
    """TPU VMs expose /dev/accel* (v4, v5e) or /dev/vfio (v5p, v6e); NVIDIA GPUs /dev/nvidia*."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or glob.glob("/dev/nvidia[0-9]*"))


def configure(cpu_devices: int | None) -> None:
    """On a machine without an accelerator, run on the CPU without probing for a TPU (libtpu would print
    start-up warnings); `cpu_devices` simulates that many CPU devices. Must run before JAX initialises."""
    import jax

    if not os.environ.get("JAX_PLATFORMS") and not has_accelerator():
        jax.config.update("jax_platforms", "cpu")
    if cpu_devices:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # multi-process CPU runs need it
