"""Launch scaletrain on Cloud TPU slices: `python launch/tpu.py COMMAND --config launch/configs/NAME.yaml [--dry-run]`.

Commands: create (a queued resource: one slice, or several for multislice), setup (scaletrain on every worker:
this checkout copied over, or a git ref), run (train.py on every worker of every slice, run_dir under the
bucket), sweep (a sweep's variants one after another on the same slice), status, logs, delete, and manifest (a
GKE JobSet for teams on GKE). `--dry-run` prints every command, one per line, and runs nothing; `run --local N`
runs the same training command as N local processes joined by jax.distributed on the CPU. Before create, setup, run
and sweep print or run anything, what would fail only on the TPU VMs is checked here (`check`). docs/launch.md.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scaletrain.__main__ import EXIT_USAGE, Parser  # noqa: E402
from scaletrain.config import read_mapping  # noqa: E402
from scaletrain.errors import ConfigError  # noqa: E402
from scaletrain.facts import hardware as hw  # noqa: E402

# The default TPU VM runtime version of each generation. Accelerator types and zones: hardware.yaml's cloud_tpu.
RUNTIMES = {"v4": "tpu-ubuntu2204-base", "v5e": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5",
            "v6e": "v2-alpha-tpuv6e"}
# The commands that rent TPUs or train on them: `check` runs before any of their commands is printed or run.
SPENDING = ("create", "setup", "run", "sweep")
CAPACITY = ("on-demand", "spot", "reserved")
MEGASCALE_PORT = 8080
_KEYS = {"project", "zone", "accelerator", "runtime_version", "slices", "capacity", "bucket", "run_name", "train",
         "sweep", "source", "env"}


@dataclasses.dataclass(frozen=True)
class Launch:
    project: str
    zone: str
    tpu: hw.CloudSlice  # one slice
    runtime_version: str
    slices: int
    capacity: str
    bucket: str
    run_name: str
    train_config: str
    overrides: tuple[str, ...]
    sweep: str | None
    source: dict | None  # None: this checkout; {"git": URL, "ref": REF}
    env: dict

    @property
    def chips(self) -> int:
        """Per slice."""
        return self.tpu.chips

    @property
    def hosts(self) -> int:
        """TPU VMs per slice: v5e and v6e slices of up to 8 chips are one host; larger ones, and v4 and v5p
        slices, have 4 chips per host."""
        if self.tpu.chip in ("v5e", "v6e") and self.chips <= 8:
            return 1
        return max(1, self.chips // 4)

    @property
    def nodes(self) -> list[str]:
        """TPU VM names: the run name for one slice; prefix-0 .. prefix-(n-1) for a multislice queued resource."""
        return [self.run_name] if self.slices == 1 else [f"{self.run_name}-{i}" for i in range(self.slices)]

    @property
    def run_dir(self) -> str:
        return f"{self.bucket.rstrip('/')}/{self.run_name}"


def load(path: str | Path) -> Launch:
    path = Path(path)
    raw = read_mapping(path, "launch file", "launch/configs/v5e-16.yaml", _KEYS)
    for key in ("project", "zone", "accelerator", "bucket", "run_name", "train"):
        if not raw.get(key):
            raise ConfigError(f"launch file {path}: '{key}' is missing" + (
                "; expected a gs://bucket[/prefix] for run directories and checkpoints" if key == "bucket" else ""))
    tpu = hw.accelerator_type(str(raw["accelerator"]))
    if not str(raw["bucket"]).startswith("gs://"):
        raise ConfigError(f"launch file {path}: bucket '{raw['bucket']}' is not a gs:// path; every worker must "
                          f"reach the run directory, so it lives in Cloud Storage")
    slices = raw.get("slices", 1)
    if not isinstance(slices, int) or slices < 1:
        raise ConfigError(f"launch file {path}: slices={slices!r}; expected a positive integer (the node count "
                          f"of the queued resource)")
    capacity = raw.get("capacity", "on-demand")
    if capacity not in CAPACITY:
        raise ConfigError(f"launch file {path}: capacity '{capacity}'; expected one of {', '.join(CAPACITY)}")
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,48}[a-z0-9])?", str(raw["run_name"])):
        raise ConfigError(f"launch file {path}: run_name '{raw['run_name']}' must be lowercase letters, digits "
                          f"and hyphens, starting with a letter (it names the TPU VMs)")
    train = raw["train"]
    if not isinstance(train, dict) or "config" not in train:
        raise ConfigError(f"launch file {path}: 'train' needs 'config' (a path in this repository) and may have "
                          f"'set' (a list of KEY=VALUE)")
    if not isinstance(train.get("set", []), list) or not isinstance(raw.get("env") or {}, dict):
        raise ConfigError(f"launch file {path}: train.set must be a list of KEY=VALUE strings and env a mapping")
    source = raw.get("source", "local")
    if source != "local" and not (isinstance(source, dict) and {"git", "ref"} <= set(source)):
        raise ConfigError(f"launch file {path}: source must be 'local' (this checkout) or {{git: URL, ref: REF}}")
    return Launch(project=str(raw["project"]), zone=str(raw["zone"]), tpu=tpu,
                  runtime_version=str(raw.get("runtime_version") or RUNTIMES[tpu.chip]),
                  slices=slices, capacity=capacity, bucket=str(raw["bucket"]), run_name=str(raw["run_name"]),
                  train_config=str(train["config"]), overrides=tuple(str(s) for s in train.get("set", [])),
                  sweep=raw.get("sweep"), source=None if source == "local" else source,
                  env={str(k): str(v) for k, v in (raw.get("env") or {}).items()})


# --- commands --------------------------------------------------------------------------------------------

def _gcloud(launch: Launch, *args: str) -> list[str]:
    return ["gcloud", "compute", "tpus", *args, f"--project={launch.project}", f"--zone={launch.zone}"]


def _ssh(launch: Launch, node: str, command: str, worker: str = "all") -> list[str]:
    return _gcloud(launch, "tpu-vm", "ssh", node, f"--worker={worker}", f"--command={command}")


def create(launch: Launch) -> list[list[str]]:
    nodes = ([f"--node-id={launch.run_name}"] if launch.slices == 1 else
             [f"--node-count={launch.slices}", f"--node-prefix={launch.run_name}"])
    capacity = {"spot": ["--spot"], "reserved": ["--reserved"], "on-demand": []}[launch.capacity]
    return [_gcloud(launch, "queued-resources", "create", launch.run_name, *nodes,
                    f"--accelerator-type={launch.tpu.accelerator}", f"--runtime-version={launch.runtime_version}",
                    *capacity)]


# TPU VM images ship Python 3.10; scaletrain needs 3.12+ (jax 0.12). uv installs one beside it, into ~/venv.
PYTHON = "~/venv/bin/python"


def _install() -> str:
    return ("(command -v ~/.local/bin/uv > /dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh) && "
            "~/.local/bin/uv venv --quiet --allow-existing --python 3.12 ~/venv && "
            f"~/.local/bin/uv pip install --quiet --python {PYTHON} -c constraints.txt -e . 'jax[tpu]==0.12.0.1'")


def setup(launch: Launch) -> list[list[str]]:
    """The same scaletrain on every worker of every slice, with the pinned JAX stack (libtpu comes with the TPU
    runtime image's jax[tpu] pin in constraints.txt)."""
    if launch.source:
        fetch = (f"rm -rf ~/scaletrain && git clone --quiet {shlex.quote(launch.source['git'])} ~/scaletrain && "
                 f"cd ~/scaletrain && git checkout --quiet {shlex.quote(str(launch.source['ref']))}")
        return [_ssh(launch, node, f"{fetch} && {_install()}") for node in launch.nodes]
    archive = f"/tmp/scaletrain-{launch.run_name}.tgz"
    commands = [["tar", "-czf", archive, "--exclude=./.venv", "--exclude=./runs", "--exclude=./.git", "-C", str(ROOT),
                 "."]]
    for node in launch.nodes:
        commands.append(_gcloud(launch, "tpu-vm", "scp", archive, f"{node}:~/scaletrain.tgz", "--worker=all"))
        commands.append(_ssh(launch, node, "rm -rf ~/scaletrain && mkdir ~/scaletrain && tar -xzf ~/scaletrain.tgz "
                                           f"-C ~/scaletrain && cd ~/scaletrain && {_install()}"))
    return commands


def train_sets(launch: Launch, run_dir: str, extra: tuple[str, ...] = ()) -> list[str]:
    """train.py's overrides: the launch file's, `extra`, run_dir, and for a multislice job the data-parallel DCN
    axis over the slices (unless the overrides place the slices themselves)."""
    sets = [*launch.overrides, *extra, f"run_dir={run_dir}"]
    if launch.slices > 1 and not any(s.startswith("mesh.dcn_") for s in sets):
        sets.append(f"mesh.dcn_data={launch.slices}")
    return sets


def train_args(launch: Launch, run_dir: str, extra: tuple[str, ...] = ()) -> list[str]:
    """train.py's arguments: the launch file's config and train_sets."""
    return ["train.py", "--config", launch.train_config,
            *(a for s in train_sets(launch, run_dir, extra) for a in ("--set", s))]


def sweep_variants(launch: Launch) -> list[tuple[str, str, tuple[str, ...]]]:
    """The launch file's sweep: each variant's name, run_dir (run_dir/sweep/NAME) and overrides beyond the launch
    file's. Raises ConfigError for a missing or bad sweep file."""
    from scaletrain.planner import sweep as sweep_lib

    if not launch.sweep:
        raise ConfigError("the launch file has no 'sweep' (a sweep file, e.g. configs/sweeps/llama3_8b_v5p64.yaml)")
    spec = sweep_lib.load(ROOT / launch.sweep)
    out = []
    for variant in spec.variants:
        name = re.sub(r"[^a-z0-9.=-]+", "_", sweep_lib.name(variant).lower())
        # The sweep's steps (plus one for the compile) and no checkpoints: a layout is measured, not trained.
        extra = (*spec.common, *sweep_lib.overrides(variant),
                 f"steps={spec.steps + 1}", f"checkpoint.every_steps={spec.steps + 2}")
        out.append((name, f"{launch.run_dir}/sweep/{name}", extra))
    return out


def check(launch: Launch, command: str) -> None:
    """What would otherwise fail only on the TPU VMs, found here in seconds (nothing compiled): the zone offers
    the generation; the training config loads with the launch file's overrides as train.py loads it; its mesh
    degrees fill the slices and pass the trainer's parallelism checks; the planner predicts that it fits the
    chip's HBM. `run` checks the run; `create` and `setup` the run and the launch file's sweep, if any; `sweep`
    each variant, all but the fit: a sweep measures layouts, and a variant that does not fit is reported on the
    slice while the others run. Raises ConfigError."""
    hw.check_zone(launch.tpu.chip, launch.zone)
    if command != "sweep":
        _check_training(launch, "the training run", train_sets(launch, launch.run_dir), must_fit=True)
    if command == "sweep" or (command != "run" and launch.sweep):
        for name, run_dir, extra in sweep_variants(launch):
            _check_training(launch, f"sweep variant {name}", train_sets(launch, run_dir, extra), must_fit=False)


def _check_training(launch: Launch, what: str, sets: list[str], must_fit: bool) -> None:
    """train.py's config checks, the planner's mesh and the trainer's parallelism checks for the launch file's
    slices, and with `must_fit` the planner's memory per chip against its HBM: each failure one ConfigError line
    naming `what` is wrong."""
    from scaletrain import config
    from scaletrain.parallel import checks
    from scaletrain.planner import roofline

    machine = launch.tpu.accelerator if launch.slices == 1 else f"{launch.slices} x {launch.tpu.accelerator}"
    where = f"{what} ({launch.train_config} on {machine})"
    hardware = launch.tpu.hardware(launch.slices)
    try:
        cfg = config.load(ROOT / launch.train_config, sets)
        plan = roofline.plan(cfg, hardware)  # raises for mesh degrees that do not fill the slices
        # The trainer's checks read a mesh's axis sizes only: the planned mesh's stand in for the slice's devices.
        checks.check(cfg, plan["mesh"]["sizes"])
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if must_fit and not plan["fits"]:
        gb = {k: v / roofline.GB for k, v in plan["memory_per_device_bytes"].items()}
        capacity = plan["hbm_capacity_bytes"] / roofline.GB
        raise ConfigError(
            f"{where} does not fit: the planner predicts {gb['total']:.1f} GB per chip (parameters "
            f"{gb['params']:.1f}, optimizer {gb['optimizer']:.1f}, gradients {gb['gradients']:.1f}, activations "
            f"{gb['activations']:.1f}) of {capacity:.0f} GB HBM; expected at most {capacity:.0f} GB: more chips, "
            f"remat.policy=full, a smaller train.global_batch or more train.grad_accum_steps (`python -m scaletrain "
            f"plan --config {launch.train_config} --hardware {hardware}` with the same --set shows each term)")


def slice_env(launch: Launch, slice_id: int) -> dict[str, str]:
    """What each slice's processes need beyond what the TPU runtime sets: the user's environment and, across
    slices, the megascale (DCN) coordinator - worker 0 of slice 0 - and this slice's id."""
    env = dict(launch.env)
    if launch.slices > 1:
        env.update(MEGASCALE_COORDINATOR_ADDRESS=f"$COORDINATOR:{MEGASCALE_PORT}",
                   MEGASCALE_NUM_SLICES=str(launch.slices), MEGASCALE_SLICE_ID=str(slice_id),
                   MEGASCALE_PORT=str(MEGASCALE_PORT))
    return env


def _coordinator(launch: Launch) -> list[list[str]]:
    """Sets $COORDINATOR in the launcher's shell: slice 0's worker 0, by its internal address."""
    if launch.slices == 1:
        return []
    return [["COORDINATOR=$(" + shlex.join(_gcloud(launch, "tpu-vm", "describe", launch.nodes[0],
                                                   "--format=value(networkEndpoints[0].ipAddress)")) + ")"]]


def _remote_train(launch: Launch, slice_id: int, args: list[str], log: str, background: bool) -> str:
    env = " ".join(f"{k}={v if v.startswith('$') else shlex.quote(v)}" for k, v in slice_env(launch, slice_id).items())
    command = f"cd ~/scaletrain && {env + ' ' if env else ''}{PYTHON} {shlex.join(args)} > {log} 2>&1"
    return f"nohup sh -c {shlex.quote(command)} > /dev/null 2>&1 &" if background else command


def run(launch: Launch) -> list[list[str]]:
    """train.py on every worker of every slice, in the background. Run again after a preemption: the same
    run_dir, so it resumes from the bucket's newest checkpoint."""
    args = train_args(launch, launch.run_dir)
    return _coordinator(launch) + [
        _ssh(launch, node, _remote_train(launch, i, args, f"~/{launch.run_name}.log", background=True))
        for i, node in enumerate(launch.nodes)]


def sweep(launch: Launch) -> list[list[str]]:
    """Each variant of the launch file's sweep trained in turn on the same slice(s), into run_dir/sweep/NAME;
    each waits for the last (the ssh of slice 0 runs in the foreground)."""
    commands = _coordinator(launch)
    for name, run_dir, extra in sweep_variants(launch):
        args = train_args(launch, run_dir, extra)
        for i, node in reversed(list(enumerate(launch.nodes))):  # slice 0 last: its ssh waits for the run
            ssh = _ssh(launch, node, _remote_train(launch, i, args, f"~/{launch.run_name}-{name}.log",
                                                   background=i > 0))
            # A variant that fails (does not fit, say) is reported and the sweep goes on.
            commands.append([f"{line(ssh)} || echo 'variant {name} failed: see ~/{launch.run_name}-{name}.log'"]
                            if i == 0 else ssh)
    return commands


def status(launch: Launch) -> list[list[str]]:
    return [_gcloud(launch, "queued-resources", "describe", launch.run_name)]


def logs(launch: Launch) -> list[list[str]]:
    return [_ssh(launch, launch.nodes[0], f"tail -n 200 ~/{launch.run_name}.log", worker="0")]


def delete(launch: Launch) -> list[list[str]]:
    return [_gcloud(launch, "queued-resources", "delete", launch.run_name, "--force", "--quiet")]


def manifest(launch: Launch) -> str:
    """A GKE JobSet: one replicated job per slice, one pod per host, the same train.py command."""
    accelerator = {"v4": "tpu-v4-podslice", "v5p": "tpu-v5p-slice", "v5e": "tpu-v5-lite-podslice",
                   "v6e": "tpu-v6e-slice"}[launch.tpu.chip]
    chips_per_host = launch.chips // launch.hosts
    command = shlex.join(["python3", *train_args(launch, launch.run_dir)])  # the image's own Python
    env = [{"name": k, "value": v} for k, v in launch.env.items()]
    job = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": launch.run_name,
                     "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}},
        "spec": {"failurePolicy": {"maxRestarts": 10}, "replicatedJobs": [{
            "name": "slice", "replicas": launch.slices,
            "template": {"spec": {
                "parallelism": launch.hosts, "completions": launch.hosts, "backoffLimit": 0,
                "template": {"spec": {
                    "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": accelerator,
                                     "cloud.google.com/gke-tpu-topology": "x".join(map(str, launch.tpu.dims))},
                    "restartPolicy": "Never",
                    "containers": [{"name": "scaletrain", "image": "SCALETRAIN_IMAGE",
                                    "command": ["sh", "-c", f"cd /scaletrain && {command}"], "env": env,
                                    "resources": {"limits": {"google.com/tpu": chips_per_host}}}]}}}}}]},
    }
    return yaml.safe_dump(job, sort_keys=False)


def local(launch: Launch, processes: int, run_dir: str | None = None, devices_per_process: int = 4) -> list[list[str]]:
    """The `run` command's training command as `processes` local CPU processes joined by jax.distributed (one
    slice: the launch file's environment without the multislice variables), run_dir under runs/."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    args = train_args(launch, run_dir or str(ROOT / "runs" / launch.run_name))
    return [[sys.executable, *args, "--cpu-devices", str(devices_per_process), "--coordinator", f"localhost:{port}",
             "--num-processes", str(processes), "--process-id", str(i)] for i in range(processes)]


def run_local(launch: Launch, commands: list[list[str]]) -> int:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **launch.env}
    procs = [subprocess.Popen(c, cwd=ROOT, env=env) for c in commands]
    return max((p.wait() for p in procs), key=abs)


COMMANDS = {"create": create, "setup": setup, "run": run, "sweep": sweep, "status": status, "logs": logs,
            "delete": delete}


def line(command: list[str]) -> str:
    """A command as one shell line. The remote command is double-quoted so that the launcher's shell fills in
    $COORDINATOR (the multislice coordinator's address) and nothing else."""
    if len(command) == 1:  # already a shell line
        return command[0]
    return " ".join(f"--command={_double_quoted(a.removeprefix('--command='))}" if a.startswith("--command=")
                    else shlex.quote(a) for a in command)


def _double_quoted(text: str) -> str:
    escaped = re.sub(r'([\\"`$])', r"\\\1", text).replace("\\$COORDINATOR", "$COORDINATOR")
    return f'"{escaped}"'


def _plan_on_the_cpu() -> None:
    """The launcher's checks plan with JAX's abstract shapes and need no accelerator: JAX is kept to the CPU, so
    libtpu is never loaded - on a machine without a TPU it prints errors, on a TPU VM it would hold the chips
    the run is about to need. Before anything initialises JAX."""
    import jax

    jax.config.update("jax_platforms", "cpu")


def main(argv: list[str] | None = None) -> int:
    _plan_on_the_cpu()
    p = Parser(prog="python launch/tpu.py", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=(*COMMANDS, "manifest"))
    p.add_argument("--config", required=True, help="a launch file, e.g. launch/configs/v5p-64.yaml")
    p.add_argument("--dry-run", action="store_true", help="print every command, one per line; run nothing")
    p.add_argument("--local", type=int, default=None, metavar="N",
                   help="run: N local CPU processes (4 devices each) instead of the slice")
    p.add_argument("--run-dir", default=None, help="with --local: the run directory (default: runs/RUN_NAME)")
    args = p.parse_args(argv)
    try:
        launch = load(args.config)
        if args.command == "manifest":
            print(manifest(launch), end="")
            return 0
        if args.local is not None:
            if args.command != "run" or args.local < 1:
                raise ConfigError("--local N (N >= 1) goes with the run command")
            commands = local(launch, args.local, args.run_dir)
            if not args.dry_run:
                return run_local(launch, commands)
        else:
            if args.command in SPENDING:
                check(launch, args.command)
            commands = COMMANDS[args.command](launch)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    script = [line(c) for c in commands]
    if args.dry_run:
        print("\n".join(script))
        return 0
    # One shell for all of them: $COORDINATOR, set by the first line of a multislice run, reaches the others.
    code = subprocess.run(["bash", "-e", "-x", "-c", "\n".join(script)]).returncode
    if code:
        print(f"error: {args.command} stopped: a command exited with status {code} (its output is above)",
              file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
