"""The equivalence harness: tiny training runs recorded whole, and one assertion that two of them trained alike.

`run` trains the tiny model (tests/conftest.py's tiny_overrides plus the test's own) one step per batch and records
every step's metrics - the loss and the gradient norm among them - and, at the end, the parameters and Adam's first
moment `mu`, in the layer order checkpoints keep (Setup.to_disk). `assert_same` compares two runs: the loss and the
gradient norm of every step within `rtol`, and every parameter and `mu` array within `rtol` relative, in norm
(Adam turns a rounding-level difference in a near-zero gradient into a visible one for that element, so
element-wise relative error is not the measure), naming each that differs.

Why all four: with global-norm clipping and Adam the update is blind to the gradient's scale - a gradient scaled by
any factor (a psum where a pmean belongs) gives the same losses and parameters once clipping acts, and the same
parameters when it does not (Adam divides the scale out). The gradient norm shows the scale in the first case, `mu`
in the second (tests/test_equivalence.py injects both bugs and sees them caught).

`reference` is `run` computed once per test run: its result is kept on disk in a folder of the run that both
pytest-xdist workers share (tests/conftest.py sets SCALETRAIN_TEST_REFERENCES), under a lock so that two workers
never compute the same one, keyed by the resolved config, the number of devices and the batches.
A one-device reference asked for by several modules (test_parallel, test_pipeline, test_flash_attention, ...) is
computed by whichever worker asks first.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import pickle
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
import optax

from tests.conftest import tiny_overrides

# The folder of this test run's references (tests/conftest.py); without it references are kept in memory only.
CACHE_ENV = "SCALETRAIN_TEST_REFERENCES"


@dataclasses.dataclass
class Run:
    """What a run recorded: every step's metrics (host floats), and the final parameters and Adam's `mu` (host arrays,
    checkpoint layer order). `state` (the final state as Setup.to_disk gives it, on the devices: its shardings are
    the layout's) and `setup` are kept by `run`, not by `reference`."""
    metrics: list[dict[str, float]]
    params: Any
    mu: Any
    state: Any = None
    setup: Any = None

    def series(self, name: str) -> list[float]:
        return [m[name] for m in self.metrics]

    @property
    def losses(self) -> list[float]:
        return self.series("loss")

    @property
    def grad_norms(self) -> list[float]:
        return self.series("grad_norm")

    def on_host(self) -> Run:
        return Run(self.metrics, self.params, self.mu)


def adam_mu(opt_state: Any) -> Any:
    """Adam's first moment: the `mu` of the first optax ScaleByAdamState in the optimizer state."""
    states = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
              if isinstance(s, optax.ScaleByAdamState)]
    assert states, f"no optax.ScaleByAdamState in the optimizer state {jax.tree.structure(opt_state)}"
    return states[0].mu


def load_config(steps: int, *overrides: str):
    from scaletrain import config

    return config.load(None, tiny_overrides("unused", steps=steps) + list(overrides))


def mesh_devices(cfg) -> int:
    """How many devices the config's mesh takes: the product of its ICI and DCN degrees, every device if one is -1."""
    from scaletrain.config import MESH_AXES

    degrees = [cfg.mesh[a] for a in MESH_AXES] + [cfg.mesh[f"dcn_{a}"] for a in MESH_AXES]
    return len(jax.devices()) if -1 in degrees else math.prod(degrees)


def _metrics_on_host(metrics: dict) -> dict:
    return {k: float(v) if np.ndim(v) == 0 else np.asarray(v) for k, v in jax.device_get(metrics).items()}


# The step is compiled as the trainer compiles it (ahead of time, for the state's and the batch's shardings), with
# LLVM's optimisations off: the tiny model's step then compiles in half the time (init in a quarter) and runs as
# fast, and what the tests compare - partitioning, collectives, sharding - is decided before LLVM. Results differ
# from the default optimisation level's by rounding, the same for every run compared.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def run(batches: Sequence[dict], *overrides: str, devices: Sequence[jax.Device] | None = None,
        init: bool = False) -> Run:
    """The tiny model with `overrides` trained one step per batch on `devices` (by default as many as its mesh
    takes). It starts from `initial_state` - the one-device init, placed on the mesh as the trainer places a
    restored checkpoint - or with `init`, from init compiled and run on this mesh: the same values (init is
    mesh-independent, tests/test_parallel.py's test_init_is_the_same_on_every_mesh), at the cost of compiling it
    (as long as the step's compile, for the tiny model)."""
    from scaletrain.train import trainer

    cfg = load_config(len(batches), *overrides)
    setup = trainer.build(cfg, list(devices) if devices is not None else jax.devices()[:mesh_devices(cfg)])
    state = setup.init(jax.random.PRNGKey(0)) if init else start(setup, *overrides)
    step = compiled_step(setup)
    metrics = []
    for batch in batches:
        state, step_metrics = step(state, setup.put_batch(batch), setup.loss_ceiling())
        metrics.append(_metrics_on_host(step_metrics))
    state = setup.to_disk(state)
    host = jax.device_get(state)
    return Run(metrics=metrics, params=host.params, mu=adam_mu(host.opt_state), state=state, setup=setup)


def from_run_dir(run_dir: str | os.PathLike) -> Run:
    """What a training run (train.py, any number of processes) left in `run_dir`: every step's metrics from
    metrics.jsonl, and the parameters and Adam's `mu` of its newest checkpoint - the last step's - read on one
    device (checkpoints keep one layout whatever the mesh)."""
    from scaletrain import config
    from scaletrain.config import MESH_AXES
    from scaletrain.store.checkpoint import Checkpointer
    from scaletrain.train import trainer

    run_dir = Path(run_dir)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    metrics = [{k: v for k, v in record.items() if isinstance(v, (int, float))}
               for record in map(json.loads, lines) if "event" not in record]  # a straggler named is no step
    one_device = [f"mesh.{dcn}{a}=1" for dcn in ("", "dcn_") for a in MESH_AXES] + [
        "pipeline.schedule=gpipe", "pipeline.microbatches=0", "pipeline.repeats=1"]
    cfg = config.load(run_dir / "config.yaml", one_device)
    setup = trainer.build(cfg, jax.devices()[:1])
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.max_to_keep, async_save=False)
    try:
        step, state, _, _ = ckpt.restore_latest(setup.abstract_state)
    finally:
        ckpt.close()
    assert step == metrics[-1]["step"], f"{run_dir}: newest checkpoint at step {step}, metrics to {metrics[-1]}"
    host = jax.device_get(state)
    return Run(metrics=metrics, params=host.params, mu=adam_mu(host.opt_state))


def compiled_step(setup) -> Any:
    """setup.step compiled as `run` compiles it: ahead of time for the state's and the batch's shardings, with
    COMPILER_OPTIONS - for tests that drive a step themselves, and for those that read the compiled program's HLO
    or memory analysis, which LLVM's level leaves unchanged (checked on jax 0.12: identical text and
    memory_analysis at the default level and at 0 for fsdp x tensor, a remat'd pipeline and optimizer offload)."""
    return setup.step.lower(*setup.abstract_args()).compile(COMPILER_OPTIONS)


def start(setup, *overrides: str) -> Any:
    """The state `run` starts from on setup's mesh: initial_state(*overrides), placed as the trainer places a
    restored checkpoint. Spares compiling init on that mesh (init is mesh-independent)."""
    return setup.from_disk(jax.device_put(initial_state(*overrides), setup.state_shardings))


# Overrides that change where the state lives, not its values: left out when it is made on one device.
PLACEMENT = ("mesh.", "pipeline.", "sharding.", "params.offload", "optim.offload")


def initial_state(*overrides: str) -> Any:
    """The initial state, on the host in checkpoint order, of the tiny model with `overrides` (those of PLACEMENT
    left out): init's on one device, computed once per test run (like `reference`)."""
    cfg = load_config(1, *(o for o in overrides if not o.startswith(PLACEMENT)))

    def compute():
        from scaletrain.train import trainer

        setup = trainer.build(cfg, jax.devices()[:1])
        return jax.device_get(setup.to_disk(setup.init(jax.random.PRNGKey(0))))

    return _cached(_key("initial_state", _config_key(cfg, 1)), compute)


def reference(batches: Sequence[dict], *overrides: str, devices: Sequence[jax.Device] | None = None) -> Run:
    """`run`, computed once per test run (without `state` and `setup`): by default on as many devices as the mesh
    takes - one device for a config without mesh overrides."""
    cfg = load_config(len(batches), *overrides)
    count = len(devices) if devices is not None else mesh_devices(cfg)
    key = _key("run", _config_key(cfg, count), _digest(batches))
    return _cached(key, lambda: run(batches, *overrides, devices=devices).on_host())


def assert_same(got: Run, want: Run, rtol: float = 1e-5, metrics: Sequence[str] = ("loss", "grad_norm"),
                **rtols: float) -> None:
    """`got` trained like `want`: each step's `metrics` (the loss and the gradient norm) within `rtol` (as
    np.testing.assert_allclose with atol 0), and every parameter and Adam `mu` array within `rtol` relative, in
    norm; `rtols` sets one quantity's own (loss=1e-6, params=1e-6, ...). Raises one AssertionError naming every
    difference."""
    assert set(rtols) <= {*metrics, "params", "mu"}, rtols
    problems = []
    if len(got.metrics) != len(want.metrics):
        problems.append(f"{len(got.metrics)} steps, want {len(want.metrics)}")
    for name in metrics:
        tol = rtols.get(name, rtol)
        for step, (a, b) in enumerate(zip(got.series(name), want.series(name)), 1):
            if not np.isclose(a, b, rtol=tol, atol=0.0, equal_nan=True):
                problems.append(f"step {step} {name}: {a!r}, want {b!r} (relative difference "
                                f"{abs(a - b) / abs(b) if b else float('inf'):.3g} > {tol:g})")
    for what in ("params", "mu"):
        problems += _trees_differ(what, getattr(got, what), getattr(want, what), rtols.get(what, rtol))
    if problems:
        raise AssertionError(f"the runs differ in {len(problems)} place(s):\n  " + "\n  ".join(problems))


def _trees_differ(what: str, got: Any, want: Any, rtol: float) -> list[str]:
    flat_got = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(got)[0]}
    flat_want = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(want)[0]}
    problems = [f"{what}{path}: missing" for path in flat_want.keys() - flat_got.keys()]
    problems += [f"{what}{path}: unexpected" for path in flat_got.keys() - flat_want.keys()]
    for path in flat_want.keys() & flat_got.keys():
        a, b = np.asarray(flat_got[path], np.float64), np.asarray(flat_want[path], np.float64)
        if a.shape != b.shape:
            problems.append(f"{what}{path}: shape {a.shape}, want {b.shape}")
            continue
        diff, norm = np.linalg.norm(a - b), np.linalg.norm(b)
        if not diff <= rtol * norm:
            problems.append(f"{what}{path}: relative difference {diff / norm if norm else float('inf'):.3g} in "
                            f"norm > {rtol:g}")
    return sorted(problems)


def computed_once(fixture):
    """Marks a module-scoped fixture whose value is computed once per test run (it returns a `reference` or an
    `initial_state`): tests/conftest.py then lets pytest-xdist split its module's tests between workers, each
    worker's fixture reading what the first computed."""
    fixture.computed_once = True
    return fixture


# -- references kept once per test run ------------------------------------------------------------------------------

_MEMORY: dict[str, Any] = {}


def _config_key(cfg, devices: int) -> dict:
    """The resolved config, without run_dir, its mesh's one -1 replaced by the degree it takes on `devices`."""
    from scaletrain.config import MESH_AXES

    resolved = cfg.to_dict()
    resolved.pop("run_dir", None)
    mesh = dict(resolved["mesh"])
    keys = [*MESH_AXES, *(f"dcn_{a}" for a in MESH_AXES)]
    if -1 in [mesh[k] for k in keys]:
        fill = devices // math.prod(mesh[k] for k in keys if mesh[k] != -1)
        mesh = {k: fill if v == -1 else v for k, v in mesh.items()}
    resolved["mesh"] = mesh
    return {"config": resolved, "devices": devices}


def _digest(tree: Any) -> str:
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        leaf = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}{leaf.dtype}{leaf.shape}".encode())
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _cached(key: str, compute) -> Any:
    """compute(), once per test run and key: in this process's memory, and in the run's folder for other processes
    (the first to take the key's lock computes it, the others wait for it and read it)."""
    if key in _MEMORY:
        return _MEMORY[key]
    folder = os.environ.get(CACHE_ENV)
    if folder is None:
        value = compute()
    else:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{key}.pkl")
        with open(f"{path}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released with the file
            if os.path.exists(path):
                with open(path, "rb") as f:
                    value = pickle.load(f)
            else:
                value = compute()
                with open(f"{path}.{os.getpid()}", "wb") as f:
                    pickle.dump(value, f)
                os.replace(f"{path}.{os.getpid()}", path)
    _MEMORY[key] = value
    return value
