"""8 simulated CPU devices for every test, set before JAX initialises."""

import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
# The suite runs in two pytest-xdist workers (Makefile); libtpu's lockfile would let only one of them compile for a
# TPU topology. There is no TPU here to share, so the lock guards nothing.
os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
# One persistent compilation cache for the whole run, shared by both workers and every process a test starts (they
# inherit the environment): the many training processes of the resume, launch and multi-process tests compile the
# same tiny programs, and from the second on load them (about 40% of those tests' time). Cached programs are the
# compiled programs: results are unchanged. A fresh folder per run, so no run reads another's.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"scaletrain-tests-jax-cache-{_RUN}")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
# The CPU backend's LLVM passes are much of a tiny program's compile, and the suite's programs run for milliseconds:
# unoptimised, tests take 0-40% less time (measured: a ring context run 15.5 -> 13.5 s, greedy decoding in every
# FlashNorm mode 17.7 -> 10.8 s, a 1F1B memory test unchanged). libtpu's ahead-of-time compiles (test_aot, the
# planner's checks) ignore the flag: their memory and FLOP figures are identical with and without it (llama3_1b).
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"]))
# The equivalence harness's references (tests/equivalence.py), computed once per run by whichever worker asks first:
# a folder named by the first pytest process (xdist's controller, whose workers inherit it), made by the first
# reference and removed when that process ends.
_OWN_REFERENCES = "SCALETRAIN_TEST_REFERENCES" not in os.environ
if _OWN_REFERENCES:
    os.environ["SCALETRAIN_TEST_REFERENCES"] = os.path.join(
        tempfile.gettempdir(), f"scaletrain-tests-references-{os.getpid()}-{uuid.uuid4().hex[:8]}")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# The trainer's progress lines go to sys.stdout as it was when scaletrain.train.metrics was first imported (a default
# argument): imported here, that is the session's stdout, not the capture of a test that runs the trainer in its
# process (run_main, below), which is closed when that test ends.
import scaletrain.train.metrics  # noqa: E402, F401

ROOT = Path(__file__).resolve().parents[1]


def tiny_overrides(run_dir: Path | str, **extra) -> list[str]:
    """--set arguments for a 2-layer, width-64 model that compiles in seconds. No warmup: the learning rate is the
    peak from the first step (warmup's starts at 0), so every step of a test is an update."""
    values = {
        "run_dir": str(run_dir), "model.d_model": 64, "model.num_layers": 2, "model.num_heads": 4,
        "model.num_kv_heads": 2, "model.head_dim": 16, "model.d_ff": 128, "model.vocab_size": 384,
        "model.dtype": "float32", "data.seq_len": 32, "train.global_batch": 8, "optim.warmup_steps": 0,
        **extra,
    }
    return [f"{k}={v}" for k, v in values.items()]


def converted_llama(root: Path) -> Path:
    """A tiny random Hugging Face Llama (float32, the byte tokenizer's 384-id vocabulary: BOS 256, EOS 257) saved in
    root/hf and converted by `convert from-hf` into root/base, which it returns: a run to start from
    (checkpoint.init_from)."""
    import torch
    import transformers

    from scaletrain.__main__ import main

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=256, eos_token_id=257), dtype=torch.float32)
    model.save_pretrained(root / "hf")
    assert main(["convert", "from-hf", "--hf-dir", str(root / "hf"), "--out", str(root / "base")]) == 0
    return root / "base"


def lower_for_cuda(fn, *shapes) -> str:
    """`fn` lowered for `shapes` on a GPU with no GPU here: Pallas writes the Triton IR for the GPU the program is
    lowered for, here an abstract H100 (compute capability 9.0). The program's StableHLO text."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    h100 = AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("gpu",), (AxisType.Explicit,), abstract_device=h100)):
        return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def train_steps(batches, overrides: list[str], devices=None) -> tuple[list[float], dict]:
    """Losses and final parameters (on the host) of the tiny model with `overrides`, one step per batch, on
    `devices` (as many as the mesh takes by default): tests/equivalence.py's `run`, which records more."""
    from tests import equivalence

    result = equivalence.run(batches, *overrides, devices=devices)
    return result.losses, result.params


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Which tests pytest-xdist may split between workers (the Makefile's --dist loadgroup): a module whose tests use
    a module- or session-scoped fixture of its own is kept whole on one worker (an xdist_group named for it), so that
    the fixture is computed once; any other test goes to whichever worker is free - also those whose module fixtures
    are computed once per run whatever the worker (tests/equivalence.py's `computed_once`). The modules kept whole
    run first: the tests dealt one at a time then even out the two workers' ends."""
    kept_whole = set()
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        for defs in (info.name2fixturedefs.values() if info else ()):
            for fixturedef in defs:
                own = fixturedef.baseid and item.nodeid.startswith(fixturedef.baseid + "::")
                if own and fixturedef.scope != "function" and not getattr(fixturedef.func, "computed_once", False):
                    kept_whole.add(item.path)
    for item in items:
        if item.path in kept_whole:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
    items.sort(key=lambda item: item.path not in kept_whole)  # stable: each module's tests stay in order


_BUSY: dict[str, dict[str, float]] = {"worker": {}, "module": {}}


def pytest_runtest_logreport(report):
    """Each test's time (setup, call and teardown) per worker and per module, for the summary below."""
    worker = getattr(getattr(report, "node", None), "gateway", None)
    for kind, key in (("worker", worker.id if worker else "main"), ("module", report.nodeid.split("::")[0])):
        _BUSY[kind][key] = _BUSY[kind].get(key, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """Where the time went: each worker's busy seconds (how even the split was) and the slowest modules'."""
    if not _BUSY["module"]:
        return
    write = terminalreporter.write_line
    terminalreporter.write_sep("=", "time per worker and slowest modules")
    write("busy: " + ", ".join(f"{w} {t:.0f} s" for w, t in sorted(_BUSY["worker"].items())))
    for module, seconds in sorted(_BUSY["module"].items(), key=lambda kv: -kv[1])[:15]:
        write(f"{seconds:8.1f} s  {module}")


def pytest_sessionfinish(session):
    if _OWN_REFERENCES and not hasattr(session.config, "workerinput"):
        shutil.rmtree(os.environ["SCALETRAIN_TEST_REFERENCES"], ignore_errors=True)


def run_cli(args: list[str], module: bool = False, timeout: float = 300):
    """Run `python train.py ARGS`, or `python -m scaletrain ARGS` with module=True, in a subprocess."""
    import subprocess

    entry = ["-m", "scaletrain"] if module else [str(ROOT / "train.py")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, *entry, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_main(args: list[str], capfd=None, module: bool = False):
    """run_cli's result without starting a process: `python train.py ARGS` (or `python -m scaletrain ARGS` with
    module=True) as scaletrain.__main__.main in this process, its exit code and everything written to stdout and
    stderr (the file descriptors, so XLA's C++ logging too) as run_cli returns them. A fresh process costs seconds
    (Python, JAX and scaletrain imported again, the compiled programs loaded again from the cache); what a process
    of its own proves - a kill, a run beside another, a lone `error:` line at start-up - stays with run_cli.
    Without `capfd` (a module fixture has none) its output is pytest's and comes back empty. The command's settings
    of the environment and of JAX (runtime.configure) are undone after it."""
    import subprocess

    from scaletrain.__main__ import main

    saved_env = dict(os.environ)
    options = ("jax_num_cpu_devices", "jax_cpu_collectives_implementation", "jax_enable_preemption_service")
    saved = {name: getattr(jax.config, name) for name in options}
    if capfd is not None:
        capfd.readouterr()
    try:
        code = main(args if module else ["train", *args])
    finally:
        out, err = capfd.readouterr() if capfd is not None else ("", "")
        os.environ.clear()
        os.environ.update(saved_env)
        for name, value in saved.items():
            jax.config.update(name, value)
    return subprocess.CompletedProcess(args, code, out, err)


@pytest.fixture(scope="session")
def stdlib_dataset():
    """The built-in corpus, loaded once for the whole session."""
    from scaletrain import config
    from scaletrain.data import loader as data

    return data.make_dataset(config.load(None, ["data.seq_len=32"]))


@pytest.fixture(scope="module")
def batches(request, stdlib_dataset):
    """The first STEPS (the test module's constant) global batches of 8 rows of the built-in corpus."""
    from scaletrain.data import loader as data

    it = data.BatchIterator(stdlib_dataset, global_batch=8)
    return [next(it) for _ in range(request.module.STEPS)]


@pytest.fixture(scope="session")
def bucket():
    """An empty Cloud Storage bucket on a local server (tests/gcs_server.py): gs:// run directories go through the
    same libraries as on Cloud TPU (gcsfs for files, tensorstore for Orbax's arrays). The environment pointing them
    at the server is set in this process and inherited by the training processes tests start."""
    import socket
    import subprocess
    import time

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "gcs_server.py"), str(port), "scaletrain-test"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("localhost", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the Cloud Storage emulator did not start") from None
            time.sleep(0.1)
    url = f"http://localhost:{port}"
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "FSSPEC_GS_TOKEN": "anon",
           # gcsfs would ask the server's gRPC control API for the bucket's type; the emulator has none.
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    patch = pytest.MonkeyPatch()
    for key, value in env.items():
        patch.setenv(key, value)
    yield "gs://scaletrain-test"
    patch.undo()
    server.terminate()
    server.wait()
