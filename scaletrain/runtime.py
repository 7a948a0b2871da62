"""What must happen before JAX initialises: the platform choice and the simulated CPU device count."""

from __future__ import annotations

import glob
import os


def has_accelerator() -> bool:
    """TPU VMs expose /dev/accel* (v4, v5e) or /dev/vfio (v5p, v6e); NVIDIA GPUs /dev/nvidia*."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or glob.glob("/dev/nvidia[0-9]*"))


# Cold multi-host start-ups (image pulls, slow hosts) routinely exceed JAX's 300 s default.
INITIALIZATION_TIMEOUT_S = 1800


def configure(cpu_devices: int | None, coordinator: str | None = None, num_processes: int | None = None,
              process_id: int | None = None) -> None:
    """On a machine without an accelerator, run on the CPU without probing for a TPU (libtpu would print
    start-up warnings); `cpu_devices` simulates that many CPU devices per process. With a coordinator, join a
    multi-process job (jax.distributed); on a multi-host Cloud TPU slice that is detected. Must run before JAX
    initialises."""
    import jax

    if not has_accelerator():
        if not os.environ.get("JAX_PLATFORMS"):
            jax.config.update("jax_platforms", "cpu")
        # Ahead-of-time TPU compiles load libtpu here, which looks for the slice it runs on and prints a page of
        # warnings (no `error:` line would be alone on stderr). Describing a one-host "slice" silences it; the
        # topology compiled for is still the one asked for.
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
    if cpu_devices:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # collectives across CPU processes
    # SIGTERM is scaletrain's to handle (control.py agrees on it across processes); JAX's own preemption
    # notifier would compete for the signal.
    jax.config.update("jax_enable_preemption_service", False)
    if coordinator is not None:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=INITIALIZATION_TIMEOUT_S)
    elif "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""):  # a multi-host TPU slice: JAX finds its peers
        jax.distributed.initialize(initialization_timeout=INITIALIZATION_TIMEOUT_S)
