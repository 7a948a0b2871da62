"""What must happen before JAX initialises: the platform choice and the simulated CPU device count."""

from __future__ import annotations

import glob
import os
import sys
import threading


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
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",")
    if coordinator is not None:
        _join(f"{num_processes} processes to join at {coordinator} (process {process_id} of {num_processes})",
              "check that every process has started, with the same --coordinator and --num-processes",
              coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    elif len(hosts) > 1:  # a multi-host TPU slice: JAX finds its peers
        _join(f"the {len(hosts)} hosts of this TPU slice to join", "check that every host runs the same command")


def _join(what: str, hint: str, **peers) -> None:
    """jax.distributed.initialize, said before it waits (a peer that never starts would leave this process
    silent for the whole timeout). JAX's own timeout aborts the process with a C++ stack trace, so a watchdog
    gives up first, with one error line; JAX waits a minute longer. The wait releases the GIL: the timer runs."""
    import jax

    limit = _duration(INITIALIZATION_TIMEOUT_S)
    print(f"waiting for {what}; times out after {limit}", flush=True)
    watchdog = threading.Timer(INITIALIZATION_TIMEOUT_S, _give_up,
                               (f"timed out after {limit} waiting for {what}: {hint}",))
    watchdog.daemon = True
    watchdog.start()
    jax.distributed.initialize(**peers, initialization_timeout=INITIALIZATION_TIMEOUT_S + 60)
    watchdog.cancel()


def _give_up(message: str) -> None:
    """From the watchdog thread, while the main thread is blocked in C++: nothing but an exit can stop it."""
    sys.stdout.flush()
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(2)  # the command line's status for bad input (__main__.EXIT_USAGE): peers that never joined


def _duration(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"
