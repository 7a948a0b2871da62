"""What both drivers report the same way: memory per device from `compiled.memory_analysis()`, XLA's costs."""

COSTS = ("flops", "bytes accessed", "optimal_seconds")
# libtpu options of the cost compiles, as scaletrain's planner/aot.py passes them: no windowed-einsum loops
# around sharded matmuls (their bodies would be counted once, like any loop's).
NO_WINDOWED_EINSUM = {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
                      "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}


def memory(stats) -> dict:
    """Bytes per device; device_total = arguments + temporaries + outputs not aliased to (donated) inputs, the
    formula of MaxText's own report and of scaletrain's facts/fit.py."""
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
            "host_argument_size_in_bytes", "host_output_size_in_bytes", "host_alias_size_in_bytes",
            "host_temp_size_in_bytes", "generated_code_size_in_bytes")
    mem = {k: int(getattr(stats, k)) for k in keys if hasattr(stats, k)}
    mem["device_total"] = (mem["argument_size_in_bytes"] + mem["temp_size_in_bytes"] + mem["output_size_in_bytes"]
                           - mem["alias_size_in_bytes"])
    mem["host_total"] = (mem.get("host_argument_size_in_bytes", 0) + mem.get("host_temp_size_in_bytes", 0)
                         + mem.get("host_output_size_in_bytes", 0) - mem.get("host_alias_size_in_bytes", 0))
    return mem


def cost(compiled) -> dict:
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    return {k: float(c.get(k, 0.0)) for k in COSTS}
