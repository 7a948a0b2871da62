"""The scaling book's thresholds for a plan: the batch sizes above which each parallelism stays compute-bound
(`critical_batches`), and the FSDP x tensor split it recommends for a slice (`fsdp_tensor_split`)."""

from __future__ import annotations

import math
from typing import Mapping

from scaletrain.facts import hardware as hw
from scaletrain.parallel import sharding
from scaletrain.planner import comms, memory


def _criterion(rule: str, threshold: float, value: float, below: bool = False) -> dict:
    met = value < threshold if below else value > threshold
    return {"rule": rule, "threshold": threshold, "value": value, "met": met}


def critical_batches(cfg, topo: hw.Topology, axes: Mapping[str, int],
                     links: Mapping[str, list[comms.Link]]) -> dict[str, dict]:
    """scaling.md's conditions for staying compute-bound, each with its threshold, this plan's value and whether
    it is met. W is the mesh axis's ICI bandwidth as comms.Link gives it (M_X x W_ici with wraparound, so the
    thresholds read alpha / M_X etc. with alpha = C / W_ici)."""
    chip, m = topo.chip, cfg.model
    c = chip.bf16_flops
    replica_tokens = memory.replica_tokens(cfg, axes)
    out = {"hbm": _criterion("tokens per data-parallel replica (per microbatch) > C / W_hbm",
                             c / chip.hbm_bandwidth, replica_tokens)}
    w_x = sum(links[a][0].bandwidth for a in ("data", "fsdp") if links[a][0].size > 1)
    w_y = links["tensor"][0].bandwidth if links["tensor"][0].size > 1 else 0.0
    if w_x:
        out["data_parallel"] = _criterion("tokens per data-parallel device > alpha / M_X = C / (M_X W_ici)",
                                          c / w_x, replica_tokens)
    if w_y:
        out["tensor"] = _criterion("tensor ways < M_Y F / alpha", m.d_ff * w_y / c, axes["tensor"], below=True)
    if w_x and w_y:
        out["fsdp_x_tensor"] = _criterion("tokens per chip > alpha^2 / (M_X M_Y F)", c**2 / (w_x * w_y * m.d_ff),
                                          replica_tokens / axes["tensor"])
    if topo.slices > 1:
        out["dcn"] = _criterion("tokens per slice (per microbatch) > C / W_dcn", c / chip.dcn_bandwidth,
                                replica_tokens * sharding.batch_ways(axes) * sharding.seq_ways(axes) / topo.slices)
    return out


def fsdp_tensor_split(cfg, topo: hw.Topology) -> dict:
    """The book's best FSDP degree for FSDP x tensor on one slice of N chips, X_opt = sqrt((B/F)(M_X/M_Y) N)
    (scaling.md), B the slice's tokens per microbatch, laid out as the book does: tensor on one torus axis,
    FSDP on the rest (M_X = torus dims - 1, M_Y = 1; a GPU node 1 and 1). Rounded to the power-of-two tensor
    degree nearest N / X_opt (in log scale) that divides N and the heads."""
    chip, m, n = topo.chip, cfg.model, topo.chips_per_slice
    m_x, m_y = (1, 1) if chip.is_gpu else (chip.torus_dims - 1, 1)
    tokens = cfg.train.global_batch * cfg.data.seq_len / (cfg.train.grad_accum_steps * topo.slices)
    x_opt = math.sqrt(tokens / m.d_ff * m_x / m_y * n)
    ways = [2**k for k in range(n.bit_length()) if n % 2**k == 0 and m.num_heads % 2**k == 0]
    y = min(ways, key=lambda w: abs(math.log2(w) - math.log2(n / x_opt)))
    return {"x_opt": x_opt, "m_x": m_x, "m_y": m_y, "fsdp": n // y, "tensor": y}
