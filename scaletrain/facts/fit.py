"""Whether a compiled train step fits: its memory per device by role, as XLA's `memory_analysis()` says, one line
for the console, and the refusal of a step that needs more than the devices have. The trainer checks it before
its first step; the planner's `compile` and `sweep` report it."""

from __future__ import annotations

from typing import Sequence

from scaletrain.errors import ConfigError

GIB = 2**30


def compiled(stats) -> dict[str, int]:
    """Bytes per device from `compiled.memory_analysis()`: device memory by role, and host memory (pinned_host:
    offloaded activations and state). Donated inputs alias outputs, so arguments + temporaries + the outputs
    that are not aliased is the peak a step needs."""
    device = {"arguments": stats.argument_size_in_bytes, "temporaries": stats.temp_size_in_bytes,
              "outputs": stats.output_size_in_bytes - stats.alias_size_in_bytes}
    host = {"arguments": stats.host_argument_size_in_bytes, "temporaries": stats.host_temp_size_in_bytes,
            "outputs": stats.host_output_size_in_bytes - stats.host_alias_size_in_bytes}
    # XLA's own simulated peak of the live buffers, where the backend reports it: on TPU it can lie well under
    # the total (docs/planner.md), which `fits` and the planner's comparisons use.
    peak = getattr(stats, "peak_memory_in_bytes", 0) or 0
    return {**{f"device_{k}": v for k, v in device.items()}, "device_total": sum(device.values()),
            "device_peak": peak,
            **{f"host_{k}": v for k, v in host.items()}, "host_total": sum(host.values())}


def _host_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_fits(memory: dict[str, int], devices: Sequence) -> None:
    """Refuses (ConfigError) a compiled step that needs more memory than this process's devices have: HBM per
    chip on an accelerator; on a CPU, where every simulated device shares the host's memory, the free host
    memory. Better one line with the numbers than an allocation failure, or the kernel's OOM killer, mid-step."""
    if devices[0].platform == "cpu":
        need, have = (memory["device_total"] + memory["host_total"]) * len(devices), _host_available_bytes()
        what = f"{len(devices)} CPU devices need {need / GIB:.2f} GiB of host memory, which has {{have}} free"
    else:
        need, have = memory["device_total"], (devices[0].memory_stats() or {}).get("bytes_limit")
        what = f"each {devices[0].device_kind} needs {need / GIB:.2f} GiB but has {{have}}"
    if have is not None and need > have:
        raise ConfigError(f"the train step does not fit: {what.format(have=f'{have / GIB:.2f} GiB')}; lower "
                          f"train.global_batch or data.seq_len, set remat.policy, or spread the model over more "
                          f"devices (python -m scaletrain plan shows where the memory goes)")


def describe(memory: dict[str, int]) -> str:
    """One line for the console."""
    line = (f"memory per device: {memory['device_total'] / GIB:.3f} GiB (state and batch "
            f"{memory['device_arguments'] / GIB:.3f}, temporaries {memory['device_temporaries'] / GIB:.3f}, "
            f"new outputs {memory['device_outputs'] / GIB:.3f})")
    if memory["host_total"]:
        line += f"; host (pinned) {memory['host_total'] / GIB:.3f} GiB"
    return line
