"""Collective inventory: what a compiled step sends between devices, read from its optimised HLO.

Each all-gather, all-reduce, reduce-scatter, all-to-all, ragged-all-to-all and collective-permute is reported
with the bytes of the full array it gathers or reduces (V in the scaling book's notation, docs/planner.md), the
mesh axes its groups span, how many times a step runs it (trip counts of enclosing loops multiplied: a scanned
layer stack appears once in the text but runs once per layer) and whether it belongs to the forward pass, the
backward pass or the update.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from typing import Iterable

import numpy as np
from jax.sharding import Mesh

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) (" + "|".join(KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    name: str
    full_bytes: int  # the whole array gathered / reduced / exchanged, per group (V); a ragged one's bound
    group_size: int
    axes: tuple[str, ...]  # mesh axes a group spans
    count: int  # executions per step
    phase: str  # forward | backward | update
    loops: tuple[int, ...]  # trip counts of the enclosing loops, outermost first
    scatters: bool = False  # an all-reduce each device only slices its own shard of: a reduce-scatter in effect

    @property
    def effective_kind(self) -> str:
        return "reduce-scatter" if self.scatters else self.kind

    @property
    def operand_bytes(self) -> float:
        """Bytes each device contributes: its shard for an all-gather, the whole array otherwise."""
        return self.full_bytes / self.group_size if self.kind == "all-gather" else self.full_bytes

    @property
    def moved_bytes(self) -> float:
        """Bytes each device sends per execution on a ring: (X-1)/X of V, twice for an all-reduce."""
        x = self.group_size
        if self.kind == "all-reduce" and not self.scatters:
            return 2 * self.full_bytes * (x - 1) / x
        if self.effective_kind in ("all-gather", "reduce-scatter"):
            return self.full_bytes * (x - 1) / x
        return self.full_bytes  # all-to-all, collective-permute: the operand (an upper bound)


def _array_bytes(shape_text: str) -> list[int]:
    return [_DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
            for dt, dims in _ARRAY.findall(shape_text)]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return (ids.transpose(perm) if perm else ids).reshape(-1)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def replica_groups(line: str) -> list[list[int]] | None:
    """Device groups of an HLO collective, from any of the three spellings XLA prints."""
    if m := re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line):  # {{0,1},{2,3}}
        return [_ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line):  # iota
        groups, size = int(m.group(1)), int(m.group(2))
        return _iota(_ints(m.group(3)), m.group(4) and _ints(m.group(4))).reshape(groups, size).tolist()
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*\)?)\))? \{([^}]*)\}", line):
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        ids = np.arange(math.prod(sizes))
        if m.group(2):
            if im := re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", m.group(2).strip()):
                ids = _iota(_ints(im.group(1)), im.group(2) and _ints(im.group(2)))
            else:
                ids = np.array(_ints(m.group(2).strip("[]")))
        grouped = re.findall(r"'(\w+)'", m.group(3))
        if re.search(r"':\(", m.group(3)):  # sub-axis groups: not spelled out here
            return None
        order = [names.index(a) for a in names if a not in grouped] + [names.index(a) for a in grouped]
        size = math.prod(sizes[names.index(a)] for a in grouped)
        return ids.reshape(sizes).transpose(order).reshape(-1, size).tolist()
    if m := re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line):
        return [_ints(p) for p in re.findall(r"\{(\d+,\d+)\}", m.group(1))]
    return None


def mesh_axes(groups: list[list[int]], mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes along which device coordinates vary inside the groups (partition i = mesh.devices.flat[i])."""
    coords = np.array(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape)).T
    varying = set()
    for group in groups:
        c = coords[group]
        varying |= {i for i in range(c.shape[1]) if len(set(c[:, i])) > 1}
    return tuple(mesh.axis_names[i] for i in sorted(varying))


def _phase(line: str) -> str:
    op = re.search(r'op_name="([^"]*)"', line)
    op = op.group(1) if op else ""
    return "backward" if "transpose(" in op else "forward" if "jvp(" in op else "update"


def _computations(text: str) -> dict[str, list[str]]:
    comps, current = {}, None
    for line in text.splitlines():
        if m := _COMPUTATION.match(line):
            current = comps.setdefault(m.group(1), [])
        elif current is not None:
            current.append(line)
    return comps


def _users(lines: list[str], value: str) -> list[str]:
    use = re.compile(rf"%{re.escape(value)}(?=[,)\s])")
    return [line for line in lines if use.search(line.split(" = ", 1)[-1])]


def _only_sliced(lines: list[str], value: str, comps: dict[str, list[str]]) -> bool:
    """Every use of `value` takes a dynamic slice of it - directly, through tuple elements, bitcasts and
    reshapes, or inside a fusion: how XLA's CPU backend, and its TPU backend for some shapes, spell a
    reduce-scatter."""
    users = _users(lines, value)
    for user in users:
        name = user.split(" = ", 1)[0].strip().removeprefix("ROOT ").lstrip("%")
        if re.search(r" (get-tuple-element|bitcast|reshape|copy)\(", user):
            if not _only_sliced(lines, name, comps):
                return False
        elif " fusion(" in user:
            operands = re.findall(r"%([\w.\-]+)", re.search(r" fusion\(([^)]*)\)", user).group(1))
            body = comps.get(re.search(r"calls=%?([\w.\-]+)", user).group(1), [])
            for i in (i for i, operand in enumerate(operands) if operand == value):
                param = next((line.split(" = ")[0].strip().lstrip("%") for line in body
                              if re.search(rf" parameter\({i}\)", line)), None)
                if param is None or not _only_sliced(body, param, comps):
                    return False
        elif " dynamic-slice(" not in user:
            return False
    return bool(users)


def _trip_count(line: str, comps: dict[str, list[str]]) -> int:
    """A while loop's trip count: XLA's annotation (CPU) or the `i < N` of its condition (TPU)."""
    if m := re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line):
        return int(m.group(1))
    cond = comps.get(re.search(r"condition=%?([\w.\-]+)", line).group(1), [])
    constants = dict(re.findall(r"%?([\w.\-]+) = s32\[\][^ ]* constant\((\d+)\)", "\n".join(cond)))
    for c in cond:
        if "direction=LT" in c and (m := re.search(r"compare\([^)]*?%?([\w.\-]+)\)", c)) and m.group(1) in constants:
            return int(constants[m.group(1)])
    return 1


def _loops(comps: dict[str, list[str]]) -> dict[str, tuple[int, ...]]:
    """For every computation reachable from the entry, the trip counts of the loops around it."""
    entry = next(reversed(comps))  # the entry computation is printed last
    found, todo = {entry: ()}, [entry]
    while todo:
        name = todo.pop()
        for line in comps.get(name, []):
            body = re.search(r"body=%?([\w.\-]+)", line) if " while(" in line else None
            callees = re.findall(r"(?:calls|true_computation|false_computation)=%?([\w.\-]+)", line)
            callees += re.findall(r"%([\w.\-]+)", m.group(1)) if (m := re.search(r"branch_computations=\{([^}]*)\}",
                                                                              line)) else []
            for callee, trips in [(c, ()) for c in callees] + ([(body.group(1), (_trip_count(line, comps),))]
                                                                 if body else []):
                if callee in comps and callee not in found:
                    found[callee] = found[name] + trips
                    todo.append(callee)
    return found


def inventory(hlo_text: str, mesh: Mesh) -> list[Collective]:
    comps = _computations(hlo_text)
    loops = _loops(comps)
    out = []
    for comp, lines in comps.items():
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m or comp not in loops:
                continue
            name, shape, kind, start = m.groups()
            sizes = _array_bytes(shape)
            if start and kind in ("all-gather", "collective-permute"):
                # (operands, results[, contexts]): only the results are the collective's output
                sizes = sizes[len(sizes) // 2:] if kind == "all-gather" else sizes[1:2]
            groups = replica_groups(line)
            size = max((len(g) for g in groups), default=1) if groups else 1
            if kind == "collective-permute":
                size = 2
            common = dict(kind=kind, group_size=size, axes=mesh_axes(groups, mesh) if groups else ("?",),
                          count=math.prod(loops[comp]), phase=_phase(line), loops=loops[comp])
            if kind == "ragged-all-to-all":
                # The TPU's asynchronous form prints its operands' shapes in its own: (input, output buffer, 4
                # offsets), output buffer, ...; the synchronous form's operands are found by name.
                sizes = [min(sizes[:2]) if start else _ragged_bytes(line, lines, sum(sizes))]
            if kind != "all-reduce":
                total = sum(sizes)
                out.append(Collective(name=name, full_bytes=total * size if kind == "reduce-scatter" else total,
                                      **common))
                continue
            # XLA combines small all-reduces into one tuple: split it into the elements each device only
            # slices (reduce-scatters in effect) and the rest.
            scattered = [_element_sliced(lines, name, i, len(sizes), comps) for i in range(len(sizes))]
            for flag in sorted(set(scattered)):
                out.append(Collective(name=name, scatters=flag, full_bytes=sum(
                    b for b, f in zip(sizes, scattered) if f == flag), **common))
    return out


def _ragged_bytes(line: str, lines: list[str], output_bytes: int) -> int:
    """The bytes a ragged all-to-all moves at most: its rows are run-time values, but a device sends at most its
    first operand and receives at most its output buffer - the smaller of the two: the rows sent for a dispatch,
    the rows returned for a combination (models/mixtral/moe.py). A compiled module prints operands by name alone: their
    shapes are where the computation defines them."""
    m = re.search(r" ragged-all-to-all\(([^%]*)%([\w.\-]+)", line)
    operand = _array_bytes(m.group(1))[:1]
    if not operand:
        define = re.compile(rf"^\s*(?:ROOT )?%{re.escape(m.group(2))} = (.+?) [a-z][\w\-]*\(")
        operand = [sum(_array_bytes(d.group(1))) for d in map(define.match, lines) if d][:1]
    return min([output_bytes, *operand])


def _element_sliced(lines: list[str], name: str, index: int, elements: int, comps: dict[str, list[str]]) -> bool:
    if elements == 1:
        return _only_sliced(lines, name, comps)
    getters = [line.split(" = ", 1)[0].strip().lstrip("%") for line in _users(lines, name)
               if " get-tuple-element(" in line and re.search(rf"index={index}\b", line)]
    return bool(getters) and all(_only_sliced(lines, g, comps) for g in getters)


# Across slices XLA does not print collectives: libtpu's megascale runtime moves the data by host-transfer sends,
# each tagged with the collective it serves.
_DCN_SEND = re.compile(r'^\s*(?:ROOT )?%?[\w.\-]+ = \((.+?)\) send\(.*_xla_megascale_transfer_type="(\w+)"')


def dcn(hlo_text: str) -> dict[str, dict]:
    """What a multi-slice step sends over DCN, per chip: {transfer type (one_to_one - a pipeline's send -,
    all_reduce, all_gather, reduce_scatter): {"count": sends per step, "bytes": the bytes they carry, "sizes":
    {bytes of one send: sends per step}}}, each send's array (one chip's) times the trip counts of the loops around
    it. Empty for one slice."""
    comps = _computations(hlo_text)
    loops = _loops(comps)
    totals: dict[str, dict] = {}
    for comp, lines in comps.items():
        for line in lines:
            if comp in loops and (m := _DCN_SEND.match(line)):
                count, size = math.prod(loops[comp]), _array_bytes(m.group(1))[0]
                kind = totals.setdefault(m.group(2).lower(), {"count": 0, "bytes": 0, "sizes": {}})
                kind["count"] += count
                kind["bytes"] += count * size
                kind["sizes"][size] = kind["sizes"].get(size, 0) + count
    return totals


def summary(collectives: Iterable[Collective]) -> dict[str, dict[str, float]]:
    """{effective kind: {"count": executions per step, "bytes": full-array bytes per step}}."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for c in collectives:
        totals[c.effective_kind]["count"] += c.count
        totals[c.effective_kind]["bytes"] += c.count * c.full_bytes
    return dict(totals)
