"""The training loop: build (mesh, shardings, jitted init and step), then init or resume, step, log, checkpoint.

`build` is separate from `run` so that tests, benchmarks and ahead-of-time compiles use exactly the
objects a training run uses.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.metadata
import math
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from scaletrain import config as config_lib
from scaletrain import models as model_lib
from scaletrain.data import loader as data_lib
from scaletrain.data import tokenizer as tokenizer_lib
from scaletrain.errors import CheckpointError, UserError, first_line
from scaletrain.facts import fit, flops, hardware
from scaletrain.models import lora, mtp
from scaletrain.parallel import checks, context, sharding
from scaletrain.parallel import mesh as mesh_lib
from scaletrain.store import storage
from scaletrain.store.checkpoint import Checkpointer, check_resumable, params_source, read_metadata
from scaletrain.store.run_lock import RunLock
from scaletrain.train import goodput, init_from, layout, offload, optim
from scaletrain.train import objective as objective_lib
from scaletrain.train.control import Control, Preemption
from scaletrain.train.evaluation import Evaluator
from scaletrain.train.loop import Loop
from scaletrain.train.metrics import MetricsLog, summary
from scaletrain.train.runner import Runner
from scaletrain.train.spike import SpikeRule
from scaletrain.train.step import TrainState, make_eval_step, make_logprobs, make_train_step, with_reference
from scaletrain.train.trainable import Partition
from scaletrain.train.watchdog import Watchdog

EXIT_DIVERGED = 1

BATCH_KEYS = {"tokens": jnp.int32, "targets": jnp.int32, "positions": jnp.int32, "segment_ids": jnp.int32,
              "loss_mask": jnp.float32}
# DPO's reference log-probs per token, where the data carries them (dpo.reference precomputed).
@dataclasses.dataclass
class Setup:
    cfg: Any
    mesh: Mesh
    model_cfg: model_lib.ModelConfig
    runner: Runner
    state_shardings: TrainState
    grad_shardings: Any  # where the step places the gradients (ZeRO-2 and FSDP: scattered)
    logical_state: TrainState  # the logical axis names of every array
    abstract_state: TrainState  # ShapeDtypeStructs carrying their shardings
    batch_sharding: NamedSharding
    init: Callable[[jax.Array], TrainState]
    step: Callable[[TrainState, dict, jax.Array], tuple[TrainState, dict]]  # (state, batch, loss ceiling)
    # (params, batch, DPO's reference copy or None) -> (loss sum, what it is a mean over: tokens, pairs)
    eval_step: Callable[[Any, dict, Any], tuple[jax.Array, jax.Array]]
    logprobs: Callable[[Any, dict], jax.Array]  # (params, batch) -> each target's log-prob [batch, seq]
    # The layer order checkpoints keep (canonical) <-> the one in memory (a circular pipeline's), of a state or of
    # its parameters alone, donating the reordered arrays; the identity for every other layout.
    to_disk: Callable[[Any], Any] = lambda tree: tree
    from_disk: Callable[[Any], Any] = lambda tree: tree
    # Under context parallelism, the sequence position each slot of a laid-out sequence holds (context.order).
    seq_order: np.ndarray | None = None
    parts: Partition = Partition()  # the parameters trained and the frozen (LoRA's base: train/trainable.py)
    # Where the frozen base is kept when checkpoints leave it out: the checkpoint.init_from it was read from ("":
    # checkpoints hold every parameter). Set by the run once it knows the base is that checkpoint's as it is.
    base_from: str = ""

    def saved(self, state: TrainState) -> TrainState:
        """What a checkpoint holds of a state (in checkpoint order): all of it but DPO's reference copy, and but
        the base where it is kept at base_from - both read from checkpoint.init_from again on a resume."""
        state = state.replace(reference=None)
        return state.replace(params=self.parts.trainable(state.params)) if self.base_from else state

    @property
    def abstract_saved(self) -> TrainState:
        return self.saved(self.abstract_state)

    def with_base(self, saved: TrainState, base: Any, reference: Any) -> TrainState:
        """The state from what a checkpoint holds of it (`saved`), the frozen base and DPO's reference copy
        (checkpoint order; each None where the state has none)."""
        state = saved.replace(reference=reference)
        return state.replace(params=self.parts.join(saved.params, base)) if self.base_from else state

    def put_batch(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows (data.process_rows) -> global batch arrays on the mesh, each sequence laid out for
        the `context` axis, with the multi-token prediction modules' tokens ahead where the model has them."""
        if self.cfg.model.mtp_depth:  # shifted in sequence order, before the layout (models/mtp.py)
            local = local | mtp.lookahead(local, self.cfg.model.mtp_depth)
        return data_lib.to_global(context.lay_out(local, self.seq_order), self.batch_sharding,
                                  self.cfg.train.global_batch)

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        shape = (self.cfg.train.global_batch, self.cfg.data.seq_len)
        keys = BATCH_KEYS | {name: jnp.float32 for name in data_lib.extras(self.cfg)}
        keys |= mtp.batch_keys(self.cfg.model.mtp_depth)
        return {k: jax.ShapeDtypeStruct(shape, dt, sharding=self.batch_sharding) for k, dt in keys.items()}

    def abstract_args(self) -> tuple:
        """The train step's arguments, as shapes: what it is lowered (compiled) for."""
        return (self.abstract_state, self.abstract_batch(),
                jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding.replicated(self.mesh)))

    def loss_ceiling(self, value: float = math.inf) -> jax.Array:
        """The train step's third argument: it drops the update of a step whose loss is above it (the loss-spike
        rule's `skip`); inf, none. The same value on every process."""
        return jax.make_array_from_callback((), sharding.replicated(self.mesh), lambda _: np.float32(value))


def build(cfg, devices: Sequence[jax.Device] | None = None, unroll_loops: bool = False) -> Setup:
    """Everything a run needs, from shapes only: no array is allocated here. Raises ConfigError.
    `unroll_loops` builds a step for XLA's cost estimate only (planner/aot.py)."""
    mesh = mesh_lib.make_mesh(cfg.mesh, devices)
    checks.check(cfg, mesh.shape)
    lay = layout.of(cfg, mesh.shape, unroll_loops)
    model_cfg, tx, lr, rules = lay.model_cfg, lay.tx, lay.lr, lay.rules
    params_shardings, opt_shardings, grad_shardings = lay.shardings(mesh)
    reference_kind = objective_lib.reference_kind(cfg)
    copy = reference_kind == "copy"
    logical_state = TrainState(params=lay.logical, opt_state=lay.opt_logical, step=(), rng=(None,),
                               reference=lay.logical if copy else None)
    # DPO's reference copy lies on the devices like the parameters, in the dtype each weight enters the
    # forward pass in (the compute dtype; norm gains in the parameter dtype): it only runs forward.
    reference_dtypes = model_lib.operand_dtypes(model_cfg, quantized=False)
    state_shardings = TrainState(params=params_shardings, opt_state=opt_shardings, step=sharding.replicated(mesh),
                                 rng=sharding.replicated(mesh), reference=sharding.tree_shardings(
                                     lay.params, lay.logical, rules.params, mesh) if copy else None)

    order = lay.runner.memory_order(model_cfg.num_layers)

    def init(key: jax.Array) -> TrainState:
        params_key, rng = jax.random.split(key)
        params = model_lib.init_params(model_cfg, params_key)  # canonical: the same values on any mesh
        params = lay.parts.store(params, jnp.dtype(cfg.lora.base_dtype))
        if order is not None:
            params = _layers_taken(lambda x, _: jnp.take(x, order, axis=0), lay.logical, params, lay.logical)
        # The reference copy of the initial parameters; a run replaces it with checkpoint.init_from's.
        reference = jax.tree.map(lambda p, dt: p.astype(dt), params, reference_dtypes) if copy else None
        return TrainState(params=params, opt_state=tx.init(lay.parts.trainable(params)),
                          step=jnp.zeros((), jnp.int32), rng=rng, reference=reference)

    abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                  jax.eval_shape(init, jax.random.PRNGKey(0)), state_shardings)
    batch_sharding = NamedSharding(mesh, sharding.spec(("batch", "seq"), rules.activations, mesh))
    update = optim.on_device(tx) if lay.opt_home is None else offload.streamed(
        tx, lay.parts.trainable(lay.logical), lay.opt_state, cfg.params.offload,
        fetch_layers_whole=not lay.runner.fetches_layers, logical_all=lay.logical)
    objective = objective_lib.of(cfg)
    reference = with_reference(reference_kind, lay.graphdef, lay.runner, lay.parts,
                               update.fetch_params or (lambda p: p)) if reference_kind else None
    step = make_train_step(lay.graphdef, lay.runner, update, lr, cfg.optim.grad_clip_norm,
                           cfg.train.grad_accum_steps, mesh, rules, grad_shardings, lay.parts, objective, reference,
                           dropout=bool(cfg.lora.rank and cfg.lora.dropout))
    return Setup(
        cfg=cfg, mesh=mesh, model_cfg=model_cfg, runner=lay.runner, state_shardings=state_shardings,
        grad_shardings=grad_shardings, logical_state=logical_state,
        abstract_state=abstract_state,
        batch_sharding=batch_sharding,
        init=jax.jit(init, out_shardings=state_shardings),
        step=jax.jit(step, in_shardings=(state_shardings, batch_sharding, sharding.replicated(mesh)),
                     out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=0),
        eval_step=jax.jit(make_eval_step(lay.graphdef, lay.runner, update.fetch_params, mesh, rules, objective,
                                         reference),
                          in_shardings=(state_shardings.params, batch_sharding, state_shardings.reference),
                          out_shardings=sharding.replicated(mesh)),
        logprobs=jax.jit(make_logprobs(lay.graphdef, lay.runner, update.fetch_params, mesh, rules),
                         in_shardings=(state_shardings.params, batch_sharding), out_shardings=batch_sharding),
        seq_order=context.order(cfg.data.seq_len, sharding.split_ways("seq", rules.activations, mesh.shape),
                                rules.seq_layout), parts=lay.parts,
        **({} if order is None else {"to_disk": _reorder(np.argsort(order), logical_state, state_shardings),
                                     "from_disk": _reorder(order, logical_state, state_shardings)}),
    )


def _reorder(order: np.ndarray, logical: Any, shardings: Any) -> Callable:
    """A TrainState or its parameters -> the same with every array that has a `layers` dim taken in `order` along
    it (position i gets layer order[i]), one array at a time and each donated: at most one array's extra copy on
    the devices. `logical` and `shardings`: TrainStates of logical names and of shardings."""
    def apply(tree):
        whole = isinstance(tree, TrainState)
        return _layers_taken(lambda x, s: _take(s)(x, order), logical if whole else logical.params, tree,
                             shardings if whole else shardings.params)

    return apply


def _layers_taken(take: Callable, logical: Any, tree: Any, shardings: Any) -> Any:
    """`tree` with take(array, its sharding) for every array whose first logical axis is `layers`."""
    return jax.tree.map(lambda names, x, s: take(x, s) if names[:1] == ("layers",) else x, logical, tree, shardings,
                        is_leaf=sharding.is_logical)


@functools.cache
def _take(out_sharding: NamedSharding) -> Callable:
    # Taken on the device (XLA computes nothing in host memory): an array kept in host memory (offloaded state)
    # comes in, and goes back as `out_sharding` says.
    return jax.jit(lambda x, order: jnp.take(jax.device_put(x, jax.memory.Space.Device), order, axis=0),
                   out_shardings=out_sharding, donate_argnums=0)


def run(cfg) -> int:
    """Train to cfg.steps, resuming from the newest checkpoint in cfg.run_dir. Returns the exit status."""
    preemption = Preemption()  # from the start, so a preemption during a long compile also exits 0
    try:
        return _run(cfg, preemption, time.perf_counter())
    finally:
        preemption.restore()


def checkpoint_metadata(setup: Setup) -> dict:
    """What a checkpoint says about itself: enough to restore it into any mesh and to know what made it."""
    cfg = setup.cfg
    flat = jax.tree_util.tree_flatten_with_path(setup.abstract_saved)[0]
    names = jax.tree.leaves(setup.saved(setup.logical_state), is_leaf=sharding.is_logical)
    return {
        **({"base": setup.base_from} if setup.base_from else {}),
        "scaletrain_version": importlib.metadata.version("scaletrain"),
        "config": cfg.to_dict(),
        "config_hash": config_lib.config_hash(cfg),
        "mesh": {"axes": dict(setup.mesh.shape), "devices": setup.mesh.devices.size,
                 "processes": jax.process_count()},
        "arrays": {jax.tree_util.keystr(path): {"shape": list(x.shape), "dtype": str(x.dtype), "logical": list(n)}
                   for (path, x), n in zip(flat, names)},
    }


def _lock_run_dir(cfg) -> RunLock | None:
    """The run directory, created and locked by process 0 (the others learn the outcome): the first write, so an
    unwritable directory, a missing bucket or another run in the directory fails here, before anything else."""
    lock, failure = None, None
    if jax.process_index() == 0:
        try:
            lock = RunLock(cfg.run_dir)
        except UserError as e:
            failure = e
        except Exception as e:  # noqa: BLE001 - a bucket's errors come from several libraries (auth, HTTP, OS)
            if storage.is_remote(cfg.run_dir):
                reason = ("no such bucket" if isinstance(e, FileNotFoundError) else
                          f"{type(e).__name__}: {first_line(e)}")
                failure = UserError(f"run_dir '{cfg.run_dir}': cannot write to the bucket ({reason}); expected a "
                                    f"gs:// bucket this machine's credentials can write")
            elif isinstance(e, OSError):
                failure = UserError(f"run_dir '{cfg.run_dir}' is not a writable directory ({e.strerror})")
            else:
                raise
    if jax.process_count() > 1 and multihost_utils.broadcast_one_to_all(np.int32(failure is not None)):
        failure = failure or UserError(f"run_dir '{cfg.run_dir}': process 0 could not take the run directory; "
                                       f"its error line says why")
    if failure is not None:
        raise failure
    return lock


def _initial_state(cfg, setup: Setup) -> tuple[TrainState, str]:
    state = setup.init(jax.random.PRNGKey(cfg.seed))
    if not cfg.checkpoint.init_from:
        return state, "starting at step 0"
    step, params = init_from.params(cfg, setup)
    if not setup.parts.everything:  # the fresh adapters, with the base read
        params = setup.parts.join(setup.parts.trainable(setup.to_disk(state.params)), params)
    origin = f"starting at step 0 from the parameters of {cfg.checkpoint.init_from} (step {step})"
    reference = init_from.reference(cfg, setup)
    return state.replace(params=setup.from_disk(params),
                         reference=None if reference is None else setup.from_disk(reference)), origin


def _keeping_tokenizer(cfg, run_dir):
    """The config a run directory keeps: naming its own copy of the tokenizer (RUN_DIR/tokenizer, relative, as
    storage.resolve finds it), so the run - and a run fine-tuned from it - generates and converts wherever it is
    moved or copied, whatever becomes of the tokenizer it was started with."""
    if cfg.data.tokenizer == "bytes":
        return cfg
    own, named = run_dir / "tokenizer", storage.path(cfg.data.tokenizer)
    if named != own and own not in named.parents:  # not already the run's own copy (a resume from its config)
        tokenizer_lib.copy_to(cfg.data.tokenizer, own)
    kept = copy.deepcopy(cfg)
    kept.data.tokenizer = "tokenizer"
    return kept


def _run(cfg, preemption: Preemption, began: float) -> int:
    setup = build(cfg)
    if cfg.checkpoint.init_from:
        setup = init_from.kept_base(cfg, setup)
    iterator = data_lib.make_iterator(cfg, setup.batch_sharding)  # bad data fails here, before any write
    if iterator.dropped and jax.process_index() == 0:
        what = "pairs" if cfg.data.format == "preference" else "examples"
        print(f"data: {iterator.dropped} {what} longer than data.seq_len={cfg.data.seq_len} left out", flush=True)
    evaluator = Evaluator(cfg, setup) if cfg.train.eval_every_steps else None
    lock = _lock_run_dir(cfg)
    try:
        return _run_locked(cfg, preemption, lock, setup, iterator, evaluator, began)
    finally:
        if lock is not None:
            lock.release()


def describe(cfg, setup: Setup, origin: str) -> str:
    """The start-up line: the model's size, the devices and how the model is laid out on them, where it starts."""
    count = flops.param_count(setup.model_cfg)
    active = f" ({count.active / 1e6:.2f}M active per token)" if count.active != count.total else ""
    runner = setup.runner
    pipeline = "" if runner.stages == 1 else (
        f"; pipeline {runner.schedule}, {runner.stages} stages x {runner.microbatches} microbatches"
        + (f", {runner.repeats} blocks of layers a stage" if runner.repeats > 1 else ""))
    return (f"scaletrain: {count.total / 1e6:.2f}M parameters{active} on {jax.device_count()} "
            f"{jax.devices()[0].platform} devices ({mesh_lib.describe(setup.mesh.shape)}, {cfg.sharding.preset}"
            f"{pipeline}); {origin}")


def _schedule_change(cfg, run_dir, step: int, main: bool) -> None:
    """Says, in one line, how this resume changes the learning-rate schedule of the checkpoint's run, if it does.
    Every process reads the metadata: Orbax's reads wait for all of them."""
    try:
        _, saved = read_metadata(run_dir / "checkpoints", step)
    except CheckpointError:
        return  # restored a moment ago: unreadable metadata is for `ckpt inspect` to report
    change = optim.schedule_change(saved.get("config", {}), cfg.to_dict(), step)
    if change is not None and main:
        line, moved = change
        print(f"warning: resuming with {line}" if moved else f"scaletrain: resuming with {line}",
              file=sys.stderr if moved else sys.stdout, flush=True)


def _run_locked(cfg, preemption: Preemption, lock: RunLock | None, setup: Setup, iterator,
                evaluator: Evaluator | None, began: float) -> int:
    main = jax.process_index() == 0
    run_dir = storage.path(cfg.run_dir)
    meta = checkpoint_metadata(setup)
    if not check_resumable(run_dir / "checkpoints", meta, cfg.run_dir) and cfg.checkpoint.init_from:
        # its shapes, before compiling (an int8 base as init_from holds it: float, no scales)
        params_source(cfg.checkpoint.init_from, lora.as_read(init_from.wanted(cfg, setup)))

    ledger = goodput.Ledger(cfg.run_dir, jax.process_index(), began)  # reads the run's earlier attempts; writes later
    ledger.started("startup")
    t0 = time.perf_counter()
    step_fn = setup.step.lower(*setup.abstract_args()).compile()
    ledger.started("compile")
    compiled_memory = fit.compiled(step_fn.memory_analysis())
    if main:
        print(f"compiled the train step in {time.perf_counter() - t0:.1f} s; {fit.describe(compiled_memory)}",
              flush=True)
    fit.check_fits(compiled_memory, jax.local_devices())

    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.max_to_keep, cfg.checkpoint.async_save)
    try:
        restored = ckpt.restore_latest(setup.abstract_saved)
    except BaseException:
        ckpt.close()
        raise
    base = reference = None
    if restored is not None:  # what checkpoints leave out, read from checkpoint.init_from
        base = init_from.params(cfg, setup)[1] if setup.base_from else None
        reference = init_from.reference(cfg, setup)
    rule = SpikeRule(cfg.train.spike.action, cfg.train.spike.factor, cfg.train.spike.window)
    if restored is None:
        start = 0
        state, origin = _initial_state(cfg, setup)
        origin_data = iterator.get_state()
    else:
        start, state, data_state, saved_meta = restored
        origin_data = None  # never needed: a rollback finds the checkpoint resumed from, at the latest
        state = setup.from_disk(setup.with_base(state, base, reference))
        iterator.set_state(data_state)
        rule.restore(saved_meta.get("spike"))
        origin = f"resumed at step {start}"
    ledger.started("restore" if restored is not None else "startup")
    ledger.resumed(start)
    # The run proceeds: only now is anything in the run directory changed.
    ckpt.set_aside_damaged()
    if main:
        (run_dir / "config.yaml").write_text(config_lib.to_yaml(_keeping_tokenizer(cfg, run_dir)))
        print(describe(cfg, setup, origin), flush=True)
    if restored is not None:
        _schedule_change(cfg, run_dir, start, main)
    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len

    def rewind(before: int) -> tuple[int, TrainState, dict, dict | None]:
        """A loss spike's rollback: the newest checkpoint from before step `before`, or the run's start."""
        found = ckpt.restore_latest(setup.abstract_saved, before=before)
        ckpt.set_aside_damaged()  # one found damaged on the way: out of the way of the saves to come
        if found is None:
            return 0, _initial_state(cfg, setup)[0], origin_data, None
        step, state, data_state, saved = found
        state = setup.with_base(state, init_from.params(cfg, setup)[1] if setup.base_from else None,
                                init_from.reference(cfg, setup))
        return step, setup.from_disk(state), data_state, saved.get("spike")

    def ended(outcome: str, step: int, newest: int | None, evals: list) -> None:
        total = ledger.close("finished" if outcome in ("finished", "nothing to do") else outcome.split()[0])
        if main:
            print(summary(outcome, start + 1, step, cfg.steps, tokens_per_step, time.perf_counter() - began, evals,
                          None if newest is None else str(run_dir / "checkpoints" / str(newest)), total), flush=True)

    newest = None if restored is None else start  # the newest checkpoint's step
    if start >= cfg.steps:
        ckpt.close()
        ended("nothing to do", start, newest, [])
        return 0

    control = Control(setup.mesh, preemption, cfg.checkpoint.every_minutes)
    if control.decide(control.propose()).stop:  # preempted while restoring or compiling: nothing new to save
        ckpt.close()
        ended("preempted", start, newest, [])
        if main:
            print(f"preempted before step {start + 1}; rerun the same command to resume", flush=True)
        return 0

    reference = objective_lib.runs_reference(cfg)
    flops_per_step = flops.flops_per_token(setup.model_cfg, cfg.data.seq_len, reference) * tokens_per_step
    mix = (cfg.model.quantization, flops.quantized_share(setup.model_cfg, cfg.data.seq_len, reference))
    peak = hardware.peak_flops(jax.devices(), cfg.hardware.peak_flops_per_device, *mix)
    if main:  # which peak MFU divides by: measured now, or cached and when
        print(f"scaletrain: {hardware.peak_note(jax.devices(), cfg.hardware.peak_flops_per_device, *mix)}", flush=True)
    log = MetricsLog(cfg.run_dir, cfg.steps, start, enabled=main)
    ledger.logged(log.last_logged)
    hang = cfg.train.hang
    watchdog = Watchdog(cfg.run_dir, jax.process_index(), hang.factor, hang.seconds, hang.exit)
    try:
        outcome = Loop(cfg, setup, step_fn, state, start, newest, iterator, evaluator, ckpt, lock, meta, ledger,
                       control, log, watchdog, rule, rewind, flops_per_step, peak).run()
    finally:
        watchdog.close()
        log.close()
        ckpt.close()
    ended(outcome.ended, outcome.step, outcome.newest, log.evals)
    if outcome.error is not None:
        if main:
            print(f"error: {outcome.error}", file=sys.stderr, flush=True)
        return EXIT_DIVERGED
    if main and outcome.ended == "preempted":
        print(f"preempted: checkpointed at step {outcome.step}; rerun the same command to resume", flush=True)
    return 0
