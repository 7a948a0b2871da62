"""Which meshes the trainer accepts for a config: one set of checks, for the trainer (an error before anything is
built), the launcher (before a slice is rented) and the planner (a warning: it plans a refused mesh all the
same). `sharding.tree_shardings` checks every array's divisibility on top of these."""

from __future__ import annotations

from typing import Mapping

from scaletrain.errors import ConfigError


def shards_kv_heads(num_kv_heads: int, tensor: int) -> bool:
    """Key/value heads are split over `tensor` where it divides them, and replicated over it otherwise (each
    device keeps every K/V head and uses those its query heads share)."""
    return num_kv_heads % tensor == 0


def problems(cfg, axis_sizes: Mapping[str, int]) -> list[str]:
    """What the trainer would refuse about a mesh of these axis sizes (ICI x DCN), said plainly: the divisibility
    users trip over most, and the parallelisms not built yet. Empty when it would train."""
    out = []
    m, tensor = cfg.model, axis_sizes["tensor"]
    for key in ("num_heads", "d_ff", "vocab_size"):
        if m[key] % tensor:
            out.append(f"model.{key}={m[key]} is not divisible by mesh.tensor={tensor}")
    kv = m.num_kv_heads
    if kv % tensor and tensor % kv:
        out.append(f"model.num_kv_heads={kv} and mesh.tensor={tensor}: key/value heads are sharded over tensor "
                   f"when it divides them and replicated when they divide it; neither holds")
    if cfg.sharding.sequence_parallel and tensor > 1 and cfg.data.seq_len % tensor:
        out.append(f"data.seq_len={cfg.data.seq_len} is not divisible by mesh.tensor={tensor}, which splits the "
                   f"sequence with sharding.sequence_parallel=true")
    if m.num_layers % axis_sizes["pipeline"]:
        out.append(f"model.num_layers={m.num_layers} is not divisible by mesh.pipeline={axis_sizes['pipeline']}")
    for axis in ("pipeline", "expert"):
        if axis_sizes[axis] > 1:
            out.append(f"mesh.{axis}={axis_sizes[axis]}: {axis} parallelism is not implemented yet; use the data, "
                       f"fsdp and tensor axes")
    if cfg.params.offload and cfg.train.grad_accum_steps > 1:
        out.append("params.offload=true needs train.grad_accum_steps=1: the gradients of offloaded parameters land "
                   "in host memory, where microbatches cannot be summed")
    micro = cfg.train.global_batch // cfg.train.grad_accum_steps
    ways = axis_sizes["data"] * axis_sizes["fsdp"]
    if micro % ways:
        out.append(f"the microbatch train.global_batch / train.grad_accum_steps = {micro} is not divisible by "
                   f"mesh.data x mesh.fsdp = {ways} (with DCN degrees), which shard the batch")
    return out


def check(cfg, axis_sizes: Mapping[str, int]) -> None:
    """Raises ConfigError with the first of `problems`."""
    found = problems(cfg, axis_sizes)
    if found:
        raise ConfigError(found[0])
