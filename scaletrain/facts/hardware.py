"""The chip table (hardware.yaml) and what it says of a machine: the peak FLOP/s of the devices a run is on (or a
measured CPU peak), for the planner a chip's full spec and a parsed slice topology such as `v5p:4x4x4`, and for
the launcher the Cloud TPU accelerator types that exist (`v5p-64` is a 2x4x4 slice) and the zones that offer them."""

from __future__ import annotations

import bisect
import functools
import json
import math
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import yaml

from scaletrain.errors import ConfigError

_TABLE = Path(__file__).with_name("hardware.yaml")
_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "scaletrain" / "cpu_peak.json"


class _Loader(yaml.SafeLoader):
    """YAML 1.2 floats: PyYAML follows YAML 1.1, which reads 2.75e14 (no '+' in the exponent) as a string."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                              list("-+0123456789."))


@functools.cache
def table() -> dict[str, dict]:
    return yaml.load(_TABLE.read_text(), Loader=_Loader)


def chip(device_kind: str) -> str | None:
    """The table entry whose device_kinds best (longest) match a jax device_kind, e.g. 'TPU v5 lite' -> v5e."""
    matches = [(len(k), name) for name, spec in table().items() for k in spec["device_kinds"] if k in device_kind]
    return max(matches)[1] if matches else None


def _best_seconds(fn, arg, repeats: int = 5) -> float:
    """The fastest of `repeats` timed calls after a warm-up: a busy machine only ever slows a call down."""
    fn(arg).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(arg).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def measure_cpu_peak(n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of a large float32 matmul on the host CPU (the fastest of `repeats`, ~0.1 s each): the honest peak
    for CPU runs, which all simulated devices share."""
    import jax
    import jax.numpy as jnp

    a = jax.device_put(jnp.ones((n, n), jnp.float32), jax.devices("cpu")[0])
    return 2 * n**3 / _best_seconds(jax.jit(lambda x: x @ x), a, repeats)


def measure_cpu_bandwidth(n: int = 2**26) -> float:
    """Bytes/s of the host's memory: a 256 MiB float32 array read and written once."""
    import jax
    import jax.numpy as jnp

    a = jax.device_put(jnp.ones((n,), jnp.float32), jax.devices("cpu")[0])
    return 2 * 4 * n / _best_seconds(jax.jit(lambda x: x + 1), a)


# A cached CPU measurement is checked again (measured, and replaced only if higher) once it is this old, and
# whenever SCALETRAIN_MEASURE_PEAK=1: one taken while the machine was busy does not stay the peak for good.
RECHECK_AFTER_S = 24 * 3600


@dataclass(frozen=True)
class Measured:
    """A measured CPU figure: the highest ever taken on this machine, when it was taken (unix time; 0 for a
    cache written before the time was kept), and what this process measured (None: it used the cache)."""

    value: float
    at: float
    now: float | None = None

    def describe(self, unit: float = 1e9, name: str = "GFLOP/s") -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.at)) if self.at else "at an unknown time"
        if self.now is None:
            return f"{self.value / unit:.0f} {name}, cached (measured {when}; {_CACHE})"
        if self.now >= self.value:
            return f"{self.value / unit:.0f} {name}, measured now (best of repeats; cached in {_CACHE})"
        return (f"{self.value / unit:.0f} {name}, cached (measured {when}); measured now {self.now / unit:.0f}, "
                f"lower, so the cached best stands")


_SEEN: dict[str, Measured] = {}  # per process: measured or read once


def cpu_peak() -> float:
    return cpu_peak_measured().value


def cpu_peak_measured(recheck: bool = False) -> Measured:
    """The CPU's matmul peak with where it came from; `recheck` measures again now (kept if higher)."""
    return _measured("", measure_cpu_peak, recheck)


def cpu_bandwidth() -> float:
    return _measured("/bandwidth", measure_cpu_bandwidth).value


def _measured(what: str, measure, recheck: bool = False) -> Measured:
    """Measured per machine (CPU model and core count) and cached, keeping the highest measurement ever taken:
    a busy machine only reads low, so a lower reading never replaces a higher one. Checked again once a day
    (RECHECK_AFTER_S), with `recheck` or SCALETRAIN_MEASURE_PEAK=1; at most once per process."""
    key = f"{platform.processor() or platform.machine()}/{os.cpu_count()}{what}"
    if key in _SEEN and not recheck:
        return _SEEN[key]
    try:
        cached = json.loads(_CACHE.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key)
    if isinstance(entry, (int, float)):  # a cache written before times were kept: checked again
        entry = {"value": float(entry), "at": 0.0, "checked": 0.0}
    recheck = recheck or os.environ.get("SCALETRAIN_MEASURE_PEAK") == "1"
    if entry is not None and not recheck and time.time() - entry.get("checked", 0.0) < RECHECK_AFTER_S:
        _SEEN[key] = Measured(entry["value"], entry["at"])
        return _SEEN[key]
    now, at = measure(), time.time()
    if entry is None or now > entry["value"]:
        entry = {"value": now, "at": at}
    entry["checked"] = at
    cached[key] = entry
    try:
        _CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp = _CACHE.with_name(f"{_CACHE.name}.{os.getpid()}")
        tmp.write_text(json.dumps(cached))
        os.replace(tmp, _CACHE)  # whole or not at all: processes of one job may measure at once
    except OSError:
        pass  # an unwritable cache only costs a re-measurement next time
    _SEEN[key] = Measured(entry["value"], entry["at"], now)
    return _SEEN[key]


def peak_flops(devices: Sequence, per_device_override: float | None = None, quantization: str = "none",
               share: float = 0.0) -> float | None:
    """Peak FLOP/s of all `devices` together, or None when unknown. On a chip of the table, `share` of the FLOPs
    at model.quantization's rate (Chip.mixed_peak); an override and a CPU's measured peak are taken as they are."""
    if per_device_override:
        return per_device_override * len(devices)
    kind = devices[0].device_kind
    if devices[0].platform == "cpu":
        return cpu_peak() * len({d.process_index for d in devices})  # one host's peak per process
    name = chip(kind)
    return spec(name).mixed_peak(quantization, share) * len(devices) if name else None


def peak_note(devices: Sequence, per_device_override: float | None = None, quantization: str = "none",
              share: float = 0.0) -> str:
    """One line naming the peak that MFU divides by and where it came from (after peak_flops)."""
    if per_device_override:
        return f"MFU against hardware.peak_flops_per_device {per_device_override:.3g} x {len(devices)} devices"
    if devices[0].platform == "cpu":
        hosts = len({d.process_index for d in devices})
        return (f"MFU against this CPU's float32 matmul peak{f' x {hosts} processes' if hosts > 1 else ''}: "
                f"{cpu_peak_measured().describe()}")
    name = chip(devices[0].device_kind)
    if not name:
        return f"MFU unknown: no peak for {devices[0].device_kind}"
    c = spec(name)
    mixed = "" if quantization == "none" else (
        f" and its {quantization} peak {c.matmul_peak(quantization) / 1e12:.0f} for the {100 * share:.0f}% of the "
        f"FLOPs model.quantization rounds ({c.mixed_peak(quantization, share) / 1e12:.0f} TFLOP/s)")
    return (f"MFU against {name}'s bf16 peak {c.bf16_flops / 1e12:.0f} TFLOP/s{mixed} x {len(devices)} chips "
            f"(hardware.yaml)")


@dataclass(frozen=True)
class Chip:
    """One chip of the table, in the planner's terms: a TPU's links are those of its torus; a GPU's "ICI" is its
    NVLink node (a switch: every GPU one hop from every other) and its "DCN" its share of the node's egress."""

    name: str
    bf16_flops: float
    int8_ops: float
    fp8_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    ici_bandwidth_oneway: float  # TPU: per link and direction; GPU: NVLink egress per GPU and direction
    ici_bandwidth_bidi: float  # TPU: per link, both directions; GPU: the same as one-way (a switch port)
    torus_dims: int | None  # None: a switched GPU node
    max_pod: tuple[int, ...] | None
    dcn_bandwidth: float | None  # per chip, across slices (GPU: across nodes)
    chips_per_host: int | None  # GPU: per NVLink node
    vmem_bytes: int | None = None
    mxu: int | None = None
    # The fractions of bf16_flops and hbm_bandwidth at which XLA's cost model times large matmuls and elementwise
    # passes on this chip (hardware.yaml: measured by benchmarks/xla_cost_model.py); 1 where not measured.
    xla_matmul_efficiency: float = 1.0
    xla_hbm_efficiency: float = 1.0
    # The passes XLA's cost model counts for a gather (over its table, over the rows gathered) and for a ragged
    # all-to-all (over the rows sent, over the buffer received into): hardware.yaml, the same benchmark.
    xla_gather_passes: tuple[float, float] = (0.0, 2.0)
    xla_exchange_passes: tuple[float, float] = (1.0, 1.0)

    @property
    def is_gpu(self) -> bool:
        return self.torus_dims is None

    def matmul_peak(self, quantization: str = "none") -> float:
        """FLOP/s of the matrix units on a model.quantization's operands (bf16 for none)."""
        return {"none": self.bf16_flops, "int8": self.int8_ops, "fp8": self.fp8_flops}[quantization]

    def mixed_peak(self, quantization: str = "none", share: float = 0.0) -> float:
        """The peak of a step whose FLOPs run `share` at the quantized rate and the rest at the bf16 rate: what
        MFU divides by, so that a quantized step's MFU stays a fraction of what its matmuls could attain."""
        if not share:
            return self.bf16_flops
        return 1.0 / ((1.0 - share) / self.bf16_flops + share / self.matmul_peak(quantization))

    @property
    def ragged_all_to_all(self) -> bool:
        """Whether a mixture of experts sends its routed rows by ragged all-to-all here (models/mixtral/moe.py: on a
        TPU; elsewhere - GPUs, this CPU, all planned as switches - by an all-to-all padded to the most a device
        sends)."""
        return not self.is_gpu


def spec(name: str) -> Chip:
    """The table entry `name` (case-insensitive; v4p is v4) as a Chip. Raises ConfigError for an unknown name."""
    key = {"v4p": "v4"}.get(name.lower(), name.lower())
    if key not in table():
        raise ConfigError(f"unknown chip '{name}'; expected one of {', '.join(table())} (scaletrain/planner/"
                          f"hardware.yaml)")
    e = table()[key]
    if "nvlink_bandwidth" in e:
        return Chip(name=key, bf16_flops=e["bf16_flops"], int8_ops=e["int8_ops"], fp8_flops=e["fp8_flops"],
                    hbm_bytes=e["hbm_bytes"], hbm_bandwidth=e["hbm_bandwidth"],
                    ici_bandwidth_oneway=e["nvlink_bandwidth"],
                    ici_bandwidth_bidi=e["nvlink_bandwidth"], torus_dims=None, max_pod=None,
                    dcn_bandwidth=e["node_egress_bandwidth"] / e["gpus_per_node"], chips_per_host=e["gpus_per_node"])
    return Chip(name=key, bf16_flops=e["bf16_flops"], int8_ops=e["int8_ops"], fp8_flops=e["fp8_flops"],
                hbm_bytes=e["hbm_bytes"], hbm_bandwidth=e["hbm_bandwidth"],
                ici_bandwidth_oneway=e["ici_bandwidth_oneway"], ici_bandwidth_bidi=e["ici_bandwidth_bidi"],
                torus_dims=e["torus_dims"],
                max_pod=tuple(e["max_pod"]) if e["max_pod"] else None, dcn_bandwidth=e["dcn_bandwidth"],
                chips_per_host=e["chips_per_host"], vmem_bytes=e["vmem_bytes"], mxu=e["mxu"],
                xla_matmul_efficiency=e.get("xla_matmul_efficiency", 1.0),
                xla_hbm_efficiency=e.get("xla_hbm_efficiency", 1.0),
                xla_gather_passes=tuple(e.get("xla_gather_passes", Chip.xla_gather_passes)),
                xla_exchange_passes=tuple(e.get("xla_exchange_passes", Chip.xla_exchange_passes)))


def cpu(devices: int) -> Chip:
    """This machine's CPU as `devices` simulated devices (`cpu:8`), to plan runs measured here: they share its
    measured matmul peak and memory bandwidth, and exchange data through that memory (a switch, as in a GPU
    node). A rough machine model - CPU collectives are memory copies - kept for comparing layouts."""
    peak, bandwidth = cpu_peak() / devices, cpu_bandwidth() / devices
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Chip(name="cpu", bf16_flops=peak, int8_ops=peak, fp8_flops=peak, hbm_bytes=ram / devices,
                hbm_bandwidth=bandwidth,
                ici_bandwidth_oneway=bandwidth, ici_bandwidth_bidi=bandwidth, torus_dims=None, max_pod=None,
                dcn_bandwidth=None, chips_per_host=devices)


@dataclass(frozen=True)
class Topology:
    """A machine to plan for: `slices` identical slices (GPU: NVLink nodes) of `dims` chips, joined by DCN."""

    chip: Chip
    dims: tuple[int, ...]  # chips along each physical torus axis of one slice; GPU: (GPUs per node,)
    slices: int
    wraps: tuple[bool, ...]  # per torus axis: has wraparound links; empty for a GPU node (a switch)

    @property
    def chips_per_slice(self) -> int:
        return math.prod(self.dims)

    @property
    def num_chips(self) -> int:
        return self.chips_per_slice * self.slices

    def __str__(self) -> str:
        return f"{f'{self.slices}x' if self.slices > 1 else ''}{self.chip.name}:{'x'.join(map(str, self.dims))}"


_TOPOLOGY = re.compile(r"(?:(\d+)x)?([a-z][a-z0-9]*):(\d+(?:x\d+)*)")
_FORM = ("[SLICESx]CHIP:DIMS, e.g. v5p:4x4x4, v5e:16x16, 2xv5p:4x4x4 (2 slices over DCN), h100:8, or cpu:8 (this "
         "machine's CPU as 8 simulated devices)")


def wraparound(chip: Chip, dims: tuple[int, ...]) -> tuple[bool, ...]:
    """Which torus axes have wraparound links (scaling.md): a 3D slice (v4, v5p, TPU7x) wraps on every axis when
    it is made of whole 4x4x4 cubes and on none otherwise; a 2D one (v5e, v6e) on each axis of size 16."""
    if chip.is_gpu:
        return ()
    if chip.torus_dims == 3:
        return (all(d % 4 == 0 for d in dims),) * 3
    return tuple(d == 16 for d in dims)


def parse(text: str) -> tuple[int, str, tuple[int, ...]]:
    """`[SLICESx]CHIP:DIMS` as (slices, chip name, dims), the chip not looked up: `topology` checks it against the
    table, `compile` (planner/aot.py) leaves a chip the table lacks to libtpu. Raises ConfigError for a malformed
    string or a count below 1."""
    match = _TOPOLOGY.fullmatch(text.strip().lower())
    if not match:
        raise ConfigError(f"hardware '{text}' is not of the form {_FORM}")
    prefix, name, dims_text = match.groups()
    if name == "cpu" and (not dims_text.isdigit() or int(dims_text) < 1 or prefix):
        raise ConfigError(f"hardware '{text}': this machine's CPU is cpu:N, N >= 1 simulated devices, e.g. cpu:8")
    dims = tuple(int(d) for d in dims_text.split("x"))
    slices = int(prefix) if prefix else 1
    if slices < 1 or min(dims) < 1:
        raise ConfigError(f"hardware '{text}': slice counts and dims must be positive; expected {_FORM}")
    return slices, name, dims


def topology(text: str) -> Topology:
    """Parse `[SLICESx]CHIP:DIMS`. TPU DIMS name every torus axis (v5p:4x4x2, v5e:8x16); a GPU's DIMS is a count
    of GPUs: up to one node (h100:4), or whole nodes (h100:32 is 4 nodes of 8), the nodes playing slices. Raises
    ConfigError for a malformed string, an unknown chip, or a slice the chip's pods cannot form."""
    slices, name, dims = parse(text)
    chip = cpu(dims[0]) if name == "cpu" else spec(name)
    if chip.is_gpu:
        per_node = chip.chips_per_host
        if len(dims) != 1 or (dims[0] > per_node and dims[0] % per_node):
            raise ConfigError(f"hardware '{text}': a {chip.name} topology is a GPU count, at most {per_node} (one "
                              f"node) or a multiple of {per_node} (whole nodes), e.g. {chip.name}:{per_node}")
        slices *= max(1, dims[0] // per_node)
        dims = (min(dims[0], per_node),)
    else:
        if len(dims) != chip.torus_dims:
            raise ConfigError(f"hardware '{text}': {chip.name} is a {chip.torus_dims}D torus, so DIMS needs "
                              f"{chip.torus_dims} sizes, e.g. {chip.name}:{'x'.join(['4'] * chip.torus_dims)}")
        # Optical switches join whole cubes into slices that no block of the pod holds (v5p 4x4x44): a shape
        # that Cloud TPU rents is a slice.
        if (chip.max_pod and any(d > m for d, m in zip(sorted(dims), sorted(chip.max_pod)))
                and not rented(chip.name, dims)):
            limit = cloud_tpus().get(chip.name, {}).get("whole_cubes_up_to")
            beyond = (f"; beyond its axes, only whole 4x4x4 cubes of at most {limit} chips (or a listed "
                      f"accelerator type) are joined into a slice" if limit else "")
            raise ConfigError(f"hardware '{text}': {'x'.join(map(str, dims))} does not fit in a {chip.name} pod of "
                              f"{'x'.join(map(str, chip.max_pod))} chips{beyond} ({_WHERE})")
    if slices > 1 and chip.dcn_bandwidth is None:
        raise ConfigError(f"hardware '{text}': hardware.yaml has no DCN bandwidth for {chip.name}, so it cannot "
                          f"plan across slices; use one slice")
    return Topology(chip=chip, dims=dims, slices=slices, wraps=wraparound(chip, dims))


@dataclass(frozen=True)
class CloudSlice:
    """A Cloud TPU accelerator type that exists: one slice of `dims` chips (per torus axis) of `chip`."""

    chip: str  # the table's name: v4, v5p, v5e, v6e
    accelerator: str  # as gcloud spells it: v5p-64, v5litepod-16
    dims: tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.dims)

    def hardware(self, slices: int = 1) -> str:
        """What topology() and the planner call `slices` of these slices: v5p:2x4x4, 2xv6e:16x16."""
        return f"{f'{slices}x' if slices > 1 else ''}{self.chip}:{'x'.join(map(str, self.dims))}"


_WHERE = "scaletrain/facts/hardware.yaml, from cloud.google.com/tpu/docs"


def cloud_tpus() -> dict[str, dict]:
    """The chips Cloud TPU rents: each one's `cloud_tpu` entry (type_prefix, cores_per_chip, slices, zones)."""
    return {name: e["cloud_tpu"] for name, e in table().items() if "cloud_tpu" in e}


def cloud_slices(chip: str) -> list[CloudSlice]:
    """Every slice of `chip` that an accelerator type names, smallest first."""
    entry = cloud_tpus()[chip]
    dims = [tuple(int(d) for d in shape.split("x")) for shape in entry["slices"]]
    return [CloudSlice(chip, f"{entry['type_prefix']}-{math.prod(d) * entry['cores_per_chip']}", d) for d in dims]


def rented(chip: str, dims: Sequence[int]) -> bool | None:
    """Whether Cloud TPU rents a slice of `chip` of this shape, in any order of its axes: an accelerator type
    names it, or every axis is a multiple of 4 (whole 4x4x4 cubes, which --topology takes) within the chip's
    `whole_cubes_up_to`. None where hardware.yaml lists no slices of the chip."""
    entry = cloud_tpus().get(chip)
    if entry is None:
        return None
    if sorted(dims) in (sorted(s.dims) for s in cloud_slices(chip)):
        return True
    limit = entry.get("whole_cubes_up_to") or 0
    return all(d % 4 == 0 for d in dims) and math.prod(dims) <= limit


def rental_note(topo: Topology) -> str | None:
    """A plan's warning for a TPU slice Cloud TPU does not rent, naming the nearest sizes it does, or whose chip
    hardware.yaml lists no slices of; None for a slice it rents, GPUs and this CPU."""
    if topo.chip.is_gpu:  # this CPU too: both are planned as switches
        return None
    chip, shape, chips = topo.chip.name, "x".join(map(str, topo.dims)), topo.chips_per_slice
    verdict = rented(chip, topo.dims)
    if verdict is None:
        return f"hardware.yaml lists no Cloud TPU slices of {chip}: not checked that a {shape} slice is rented"
    if verdict:
        return None
    listed = cloud_slices(chip)
    nearest = [s for s in listed if s.chips < chips][-1:] + [s for s in listed if s.chips > chips][:1]
    named = " and ".join(f"{s.hardware()} ({s.chips} chips)" for s in nearest)
    return (f"Cloud TPU rents no {chip} slice of {shape} ({chips} chips); the nearest it rents: {named} "
            f"({_WHERE}); planned as asked")


def accelerator_type(text: str) -> CloudSlice:
    """The slice an accelerator type names, by its gcloud prefix or the table's chip name: `v5p-64` (v4 and v5p
    count TensorCores, two per chip: 32 chips, 2x4x4), `v5litepod-16` or `v5e-16` (16 chips, 4x4). Raises
    ConfigError for an unknown generation or a size that does not exist."""
    tpus = cloud_tpus()
    prefixes = {p: name for name, e in tpus.items() for p in (name, e["type_prefix"])}
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)", text.strip().lower())
    if not match or match.group(1) not in prefixes:
        raise ConfigError(f"unknown accelerator '{text}'; expected a Cloud TPU type such as v5e-16 (v5litepod-16), "
                          f"v5p-64, v6e-256 or v4-32")
    prefix, units = match.group(1), int(match.group(2))
    chip = prefixes[prefix]
    cores = tpus[chip]["cores_per_chip"]
    slices = cloud_slices(chip)
    sizes = [s.chips * cores for s in slices]
    if units in sizes:
        return slices[sizes.index(units)]
    odd = f" ({chip} types count TensorCores, {cores} per chip: expected an even number)" if units % cores else ""
    raise ConfigError(f"accelerator {text} does not exist{odd}; {chip} sizes are {_listing(prefix, sizes, units)} "
                      f"({len(sizes)} sizes in {_WHERE})")


def _listing(prefix: str, sizes: list[int], wanted: int) -> str:
    """`v5p-8, v5p-16, ..., v5p-17920`: a short list whole, a long one as its first four sizes, the two around
    `wanted` and the last, with `...` where sizes are left out."""
    keep = range(len(sizes))
    if len(sizes) > 8:
        near = bisect.bisect(sizes, wanted)
        keep = sorted({0, 1, 2, 3, max(near - 1, 0), min(near, len(sizes) - 1), len(sizes) - 1})
    parts = []
    for before, i in zip([-1, *keep], keep):
        parts += ["..."] * (i > before + 1) + [f"{prefix}-{sizes[i]}"]
    return ", ".join(parts)


def check_zone(chip: str, zone: str) -> None:
    """Raises ConfigError unless Cloud TPU offers `chip` in `zone`."""
    tpus = cloud_tpus()
    if zone in tpus[chip]["zones"]:
        return
    others = [name for name, e in tpus.items() if zone in e["zones"]]
    has = f"it has {', '.join(others)}" if others else "no Cloud TPU is there, or the zone does not exist"
    raise ConfigError(f"zone {zone} has no {chip} ({has}); expected one of {', '.join(tpus[chip]['zones'])} "
                      f"({_WHERE}/regions-zones)")
