"""What both drivers do the same way: compile, and report memory per device from `compiled.memory_analysis()`,
XLA's costs and the kernels in the compiled program; write the result."""

import gzip
import json
import sys
import time
import traceback
from pathlib import Path

import kernels

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


def compile_into(res: dict, compile_step, out) -> None:
    """`compile_step()`'s program into `res`: compile time, costs, memory, kernels and loops (its HLO beside `out`,
    for reading by hand). A step that does not fit in HBM is a result (fits: false), reported by SystemExit."""
    t = time.time()
    try:
        compiled = compile_step()
    except Exception as e:  # noqa: BLE001 - running out of HBM is a result
        if "RESOURCE_EXHAUSTED" in str(e) or "Ran out of memory" in str(e):
            res.update(fits=False, error=str(e).splitlines()[0][:500], compile_s=round(time.time() - t, 1))
            raise SystemExit(0) from None
        raise
    res["compile_s"] = round(time.time() - t, 1)
    res["cost"] = cost(compiled)
    res["memory"] = memory(compiled.memory_analysis())
    res["fits"] = True
    hlo = compiled.as_text()
    res["kernels"] = kernels.inventory(hlo)
    res["while_loops"] = kernels.while_loops(hlo)
    with gzip.open(str(out).removesuffix(".json") + ".hlo.gz", "wt") as f:
        f.write(hlo)


def failed(res: dict, e: Exception) -> None:
    res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:500] if str(e) else ''}"
    res["traceback"] = traceback.format_exc()[-4000:]


def finish(res: dict, out, t0: float) -> None:
    """Write `res` to `out`, print its summary line and exit: 1 for an error other than not fitting."""
    res["wall_s"] = round(time.time() - t0, 1)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=1))
    print("RESULT", json.dumps({k: v for k, v in res.items() if k not in ("kernels", "traceback")}), flush=True)
    sys.exit(1 if "error" in res and res.get("fits") is not False else 0)
