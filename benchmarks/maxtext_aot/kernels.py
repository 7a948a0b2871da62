"""The Pallas (Mosaic) kernels of a compiled TPU program, read from its HLO text, and what they cost.

XLA's cost analysis counts a `tpu_custom_call` (a Mosaic kernel) as next to nothing, so its FLOPs and bytes
leave out flash attention and grouped matmuls. This module finds every such kernel in `compiled.as_text()`,
reads its operand and result shapes, and costs it with one formula per kind - the same for any framework,
since both scaletrain and MaxText run JAX's splash attention kernels (and MaxText's MoE its megablox grouped
matmuls). Pure Python (no jax): it runs in either framework's environment.

Formulas, per kernel call, with q [..., H, T, D] the queries, k/v [..., Hkv, S, D] the keys and values, B·H the
product of q's leading dims (batch x heads; query heads sharing a key/value head are counted per query head),
f the fraction of (query block, key block) pairs a causal mask visits with the kernel's own block sizes
(`causal_fraction`: blocks on the diagonal are computed whole, so f = (n + 1) / 2n for n equal blocks). A kernel
with fewer queries than keys (T < S) is one device's share of a sequence split by context parallelism: laid out
to balance the causal work (both frameworks' zig-zag), each device visits the whole S x S mask's fraction (a
contiguous split would not be balanced, and is not costed right by this):
- splash forward: QK^T and PV, 2 matmuls of 2·B·H·T·S·D each: 4·B·H·T·S·D·f;
- splash backward, dq kernel: recomputed QK^T, dO·V^T and dS·K: 6·B·H·T·S·D·f;
- splash backward, dkv kernel: recomputed QK^T, dO·V^T, P^T·dO and dS^T·Q: 8·B·H·T·S·D·f;
- splash backward, fused kernel (dq, dk and dv in one, `use_fused_bwd_kernel`): 10·B·H·T·S·D·f;
- grouped matmul (megablox gmm / tgmm; every row meets one group's weights): 2·rows·K·N, i.e. 2 x (elements of
  the first floating-point operand) x (last dim of the result);
- a kernel with integer results only (such as XLA's ragged-dot group metadata: tile indices from group sizes):
  no FLOPs, its bytes.
Bytes: every operand and result once, plus, for attention, the key/value (or for dkv the query-side) operands
read again once per visited block row. A kernel's time is max(FLOPs / peak, bytes / HBM bandwidth): the
roofline. A tpu_custom_call of any other kind is listed as uncosted.

A kernel that declares its own cost (`pl.CostEstimate`, kept in the HLO as the custom call's "cost_estimate") is
already in XLA's counts - megablox's gmm and tgmm declare theirs, splash attention does not - so it is listed
under "declared" with what it declares and not added again.

A kernel inside a while loop's body counts once per iteration (the loop's trip count: `_trip_count`; nested
loops multiplied): the scanned program's count, a cross-check of the unrolled compiles' count.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict

DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
               "s64": 8, "u64": 8, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5}
FLOAT = {"bf16", "f16", "f32", "f64", "f8e4m3fn", "f8e5m2"}
# FLOPs of a splash kernel in units of 2·B·H·T·S·D·f (one T x S x D matmul): how many such matmuls it runs.
ATTENTION_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4, "fused_bwd": 5}

_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_CALLS = re.compile(r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_DECLARED = re.compile(r'"cost_estimate":\{"flops":"(\d+)"[^}]*"bytes_accessed":"(\d+)"')


def _shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(x) for x in dims.split(",") if x)) for dt, dims in _SHAPE.findall(text)
            if dt in DTYPE_BYTES]


def _bytes(shapes) -> float:
    return sum(DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in shapes)


def _instructions(hlo: str):
    """(computation, instruction text) for every instruction; an instruction may span several lines (a kernel's
    frontend attributes hold newlines): it ends where the next one or the computation's end begins."""
    computation, current = None, None
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header and not line.startswith(" "):
            if current:
                yield computation, current
            computation, current = header.group(1), None
            continue
        if line.startswith("  ") and re.match(r"^\s+(ROOT\s+)?%[\w.\-]+\s*=", line):
            if current:
                yield computation, current
            current = line
        elif line.rstrip() == "}":  # a computation ends; "}}, metadata=..." continues a kernel
            if current:
                yield computation, current
            current = None
        elif current is not None:
            current += "\n" + line
    if current:
        yield computation, current


def _trip_count(inst: str, bodies: dict[str, list[str]]) -> int:
    """A while loop's trip count: XLA's known_trip_count where the HLO keeps it, else the one scalar integer
    constant its condition compares the counter with (a scan's `i < N`, from 0 by 1 - libtpu's optimized HLO
    drops the annotation); 1 when neither says."""
    t = _TRIP.search(inst)
    if t:
        return int(t.group(1))
    cond = re.search(r"\bcondition=%?([\w.\-]+)", inst)
    lines = bodies.get(cond.group(1), []) if cond else []
    consts = [int(m.group(1)) for line in lines
              for m in [re.search(r"=\s*[su]32\[\]\S*\s+constant\((\d+)\)", line)] if m]
    compares = [line for line in lines if " compare(" in line and "direction=LT" in line]
    return consts[0] if len(consts) == 1 and len(compares) == 1 else 1


def _multiplicities(hlo: str) -> dict[str, int]:
    """How many times each computation runs per execution of the entry: a while body runs its loop's trip count
    (_trip_count) times, nested loops multiply."""
    edges, entry = defaultdict(list), None
    for line in hlo.splitlines():
        if line.startswith("ENTRY"):
            m = _COMPUTATION.match(line)
            entry = m.group(1) if m else None
    bodies: dict[str, list[str]] = defaultdict(list)
    instructions = list(_instructions(hlo))
    for computation, inst in instructions:
        bodies[computation].append(inst)
    for computation, inst in instructions:
        trip = _trip_count(inst, bodies) if re.search(r"\swhile\(", inst) else 1
        for callee in _CALLS.findall(inst):
            is_body = re.search(r"\bbody=%?" + re.escape(callee) + r"(?![\w.\-])", inst) is not None
            edges[computation].append((callee, trip if is_body else 1))
        for group in _BRANCHES.findall(inst):
            for callee in group.split(","):
                edges[computation].append((callee.strip().lstrip("%"), 1))
    mult: dict[str, int] = defaultdict(int)
    if entry is None:
        return mult

    def visit(name: str, times: int, depth: int = 0) -> None:
        if depth > 64:
            return
        mult[name] += times
        for callee, k in edges.get(name, ()):
            visit(callee, times * k, depth + 1)

    visit(entry, 1)
    return mult


def causal_fraction(t: int, s: int, block_q: int, block_kv: int) -> float:
    """Fraction of the T x S score blocks (block_q x block_kv) a causal mask (query i sees keys <= i, queries and
    keys aligned at the start) has any visible score in: the blocks a splash kernel computes."""
    block_q, block_kv = max(1, min(block_q, t)), max(1, min(block_kv, s))
    nq, nk = math.ceil(t / block_q), math.ceil(s / block_kv)
    visited = sum(min(nk, (min(t, (i + 1) * block_q) - 1) // block_kv + 1) for i in range(nq))
    return visited / (nq * nk)


def _kind(name: str, op_name: str) -> str | None:
    label = f"{name} {op_name}".lower()
    if "splash" in label or "flash" in label:
        if "dkv" in label:
            return "dkv"
        if "dq" in label:
            return "dq"
        if "fwd" in label or "forward" in label:
            return "fwd"
        return "attention?"
    if re.search(r"\btgmm|/tgmm|tgmm", label):
        return "tgmm"
    if re.search(r"gmm", label):
        return "gmm"
    return None


def _kernel_meta(inst: str) -> dict:
    m = re.search(r'"xprof_metadata":"((?:[^"\\]|\\.)*)"', inst)
    if not m:
        return {}
    try:
        return json.loads(json.loads(f'"{m.group(1)}"'))
    except (ValueError, TypeError):
        return {}


def _cost_attention(kind: str, operands, results, meta: dict) -> tuple[float, float, dict]:
    floats = [(dt, dims) for dt, dims in operands if dt in FLOAT and len(dims) >= 2]
    q, k, v = floats[0], floats[1], floats[2]
    t, d = q[1][-2], q[1][-1]
    s = k[1][-2]
    bh = math.prod(q[1][:-2])
    # The fused backward kernel also returns dq (q's shape) beside dk and dv; the split dkv kernel does not.
    flag = meta.get("use_fused_bwd_kernel")
    fused = kind == "dkv" and (flag is True or (flag is None and any(dims == q[1] for _, dims in results)))
    key = "fused_bwd" if fused else kind
    bq, bkv = {"fwd": ("block_q", "block_kv"), "dq": ("block_q_dq", "block_kv_dq"),
               "dkv": ("block_q_dkv", "block_kv_dkv"), "fused_bwd": ("block_q_dkv", "block_kv_dkv")}[key]
    block_q, block_kv = int(meta.get(bq, 512)), int(meta.get(bkv, 512))
    f = causal_fraction(s, s, block_q, block_kv) if t < s else causal_fraction(t, s, block_q, block_kv)
    flops = 2 * ATTENTION_MATMULS[key] * bh * t * s * d * f
    base = _bytes(operands) + _bytes(results)
    if key == "dkv" or key == "fused_bwd":  # q-side (q, dO) read again per visited key block
        reread = _bytes([q]) * 2 * (f * math.ceil(s / block_kv) - 1)
    else:  # k and v read again per visited query block
        reread = _bytes([k, v]) * (f * math.ceil(t / block_q) - 1)
    return flops, base + max(0.0, reread), {"kind": key, "B*H": bh, "T": t, "S": s, "D": d, "f": round(f, 4),
                                             "blocks": [block_q, block_kv]}


def _cost_gmm(kind: str, operands, results) -> tuple[float, float, dict]:
    floats = [(dt, dims) for dt, dims in operands if dt in FLOAT and len(dims) >= 2]
    lhs = floats[0]
    out = next((dt, dims) for dt, dims in results if dt in FLOAT and len(dims) >= 2)
    flops = 2 * math.prod(lhs[1]) * out[1][-1]
    return flops, _bytes(operands) + _bytes(results), {"kind": kind, "lhs": list(lhs[1]), "out": list(out[1])}


def inventory(hlo: str) -> dict:
    """Every tpu_custom_call of a compiled program with its cost: {"kernels": [{name, kind, count, flops, bytes,
    shapes}], "flops", "bytes", "uncosted": [names], "in_loops": how many kernel calls sit in a while body,
    "declared": {"calls", "flops", "bytes"} of the kernels XLA has counted already, by their own estimates}."""
    mult = _multiplicities(hlo)
    found: dict[tuple, dict] = {}
    uncosted, in_loops = [], 0
    declared = {"calls": 0, "flops": 0.0, "bytes": 0.0}
    for computation, inst in _instructions(hlo):
        if 'custom_call_target="tpu_custom_call"' not in inst:
            continue
        name = re.match(r"^\s+(?:ROOT\s+)?%([\w.\-]+)", inst).group(1)
        op = re.search(r'op_name="([^"]*)"', inst)
        op_name = op.group(1) if op else ""
        times = mult.get(computation, 1) or 1
        if times > 1:
            in_loops += 1
        own = _DECLARED.search(inst)
        if own:  # XLA's figures hold what it declares (for ragged_dot's group metadata kernel: nothing)
            declared["calls"] += times
            declared["flops"] += int(own.group(1)) * times
            declared["bytes"] += int(own.group(2)) * times
            continue
        head = inst.split(" custom-call(", 1)[0].split("=", 1)[1]
        results = _shapes(head)
        layouts = re.search(r"operand_layout_constraints=\{(.*?)\}(?:,\s*[a-z_]+=|$)", inst, re.S)
        operands = _shapes(layouts.group(1)) if layouts else []
        kind = _kind(name, op_name)
        base = re.sub(r"\.\d+$", "", name)
        try:
            if kind is None and results and not any(dt in FLOAT for dt, _ in results):
                kind, flops, bytes_, info = "integer", 0.0, _bytes(operands) + _bytes(results), {"kind": "integer"}
            elif kind in ("fwd", "dq", "dkv"):
                flops, bytes_, info = _cost_attention(kind, operands, results, _kernel_meta(inst))
            elif kind in ("gmm", "tgmm"):
                flops, bytes_, info = _cost_gmm(kind, operands, results)
            else:
                raise ValueError(kind)
        except (IndexError, ValueError, StopIteration):
            uncosted.append(base)
            continue
        key = (base, json.dumps(info, sort_keys=True))
        entry = found.setdefault(key, {"name": base, **info, "count": 0, "flops": 0.0, "bytes": 0.0,
                                       "flops_each": flops, "bytes_each": bytes_})
        entry["count"] += times
        entry["flops"] += flops * times
        entry["bytes"] += bytes_ * times
    kernels = sorted(found.values(), key=lambda e: -e["flops"])
    return {"kernels": kernels, "flops": sum(e["flops"] for e in kernels),
            "bytes": sum(e["bytes"] for e in kernels), "calls": sum(e["count"] for e in kernels),
            "uncosted": sorted(set(uncosted)), "calls_in_loops": in_loops, "declared": declared}


def seconds(flops: float, bytes_: float, peak_flops: float, hbm_bandwidth: float) -> float:
    """A kernel's time at the chip's roofline."""
    return max(flops / peak_flops, bytes_ / hbm_bandwidth)


def kernel_seconds(inventory_: dict, peak_flops: float, hbm_bandwidth: float) -> float:
    """The kernels' time, each at the roofline, summed."""
    return sum(seconds(k["flops"], k["bytes"], peak_flops, hbm_bandwidth) for k in inventory_["kernels"])


def while_loops(hlo: str) -> list[int | None]:
    """The trip count of every while loop in a compiled program (_trip_count): an unrolled program should have
    none around its layers."""
    bodies: dict[str, list[str]] = defaultdict(list)
    instructions = list(_instructions(hlo))
    for computation, inst in instructions:
        bodies[computation].append(inst)
    return [_trip_count(inst, bodies) for _, inst in instructions if re.search(r"\swhile\(", inst)]
