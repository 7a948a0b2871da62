"""Memory per device: what XLA's compiled step says it needs (and, with the planner, what it predicts)."""

from __future__ import annotations

GIB = 2**30


def compiled(stats) -> dict[str, int]:
    """Bytes per device from `compiled.memory_analysis()`: device memory by role, and host memory (pinned_host:
    offloaded activations and state). Donated inputs alias outputs, so arguments + temporaries + the outputs
    that are not aliased is the peak a step needs."""
    device = {"arguments": stats.argument_size_in_bytes, "temporaries": stats.temp_size_in_bytes,
              "outputs": stats.output_size_in_bytes - stats.alias_size_in_bytes}
    host = {"arguments": stats.host_argument_size_in_bytes, "temporaries": stats.host_temp_size_in_bytes,
            "outputs": stats.host_output_size_in_bytes - stats.host_alias_size_in_bytes}
    return {**{f"device_{k}": v for k, v in device.items()}, "device_total": sum(device.values()),
            **{f"host_{k}": v for k, v in host.items()}, "host_total": sum(host.values())}


def describe(memory: dict[str, int]) -> str:
    """One line for the console."""
    line = (f"memory per device: {memory['device_total'] / GIB:.3f} GiB (state and batch "
            f"{memory['device_arguments'] / GIB:.3f}, temporaries {memory['device_temporaries'] / GIB:.3f}, "
            f"new outputs {memory['device_outputs'] / GIB:.3f})")
    if memory["host_total"]:
        line += f"; host (pinned) {memory['host_total'] / GIB:.3f} GiB"
    return line
