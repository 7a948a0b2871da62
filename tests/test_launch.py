"""launch/tpu.py: the exact gcloud commands for a v5e-16 slice, a v5p-64 slice and a 2 x v6e-256 multislice
(`--dry-run`), bad launch files refused in one line, the GKE JobSet, and the `run` path as 2 local processes."""

import importlib.util
import json
import sys

import pytest
import yaml

from tests.conftest import ROOT, tiny_overrides

_spec = importlib.util.spec_from_file_location("launch_tpu", ROOT / "launch" / "tpu.py")
tpu = sys.modules["launch_tpu"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tpu)

CONFIGS = ROOT / "launch" / "configs"


def _dry(capsys, command, config) -> list[str]:
    assert tpu.main([command, "--config", str(CONFIGS / config), "--dry-run"]) == 0
    return capsys.readouterr().out.splitlines()


def test_single_v5e_16_slice(capsys):
    [create] = _dry(capsys, "create", "v5e-16.yaml")
    assert create == ("gcloud compute tpus queued-resources create llama1b-v5e16 --node-id=llama1b-v5e16 "
                      "--accelerator-type=v5litepod-16 --runtime-version=v2-alpha-tpuv5-lite --spot "
                      "--project=my-project --zone=us-west4-a")
    [run] = _dry(capsys, "run", "v5e-16.yaml")
    assert run.startswith("gcloud compute tpus tpu-vm ssh llama1b-v5e16 --worker=all --command=")
    assert ("~/venv/bin/python train.py --config configs/llama3_1b.yaml --set train.global_batch=32 --set steps=2000 "
            "--set run_dir=gs://my-bucket/scaletrain/llama1b-v5e16 > ~/llama1b-v5e16.log") in run
    assert "MEGASCALE" not in run and "nohup" in run
    assert _dry(capsys, "delete", "v5e-16.yaml") == [
        "gcloud compute tpus queued-resources delete llama1b-v5e16 --force --quiet --project=my-project "
        "--zone=us-west4-a"]


def test_v5p_64_slice_counts_cores_and_sweeps_in_turn(capsys):
    [create] = _dry(capsys, "create", "v5p-64.yaml")
    assert "--accelerator-type=v5p-64 --runtime-version=v2-alpha-tpuv5 --reserved" in create
    assert tpu.load(CONFIGS / "v5p-64.yaml").chips == 32
    setup = _dry(capsys, "setup", "v5p-64.yaml")
    assert setup[0].startswith("tar -czf /tmp/scaletrain-llama8b-v5p64.tgz --exclude=./.venv")
    assert "scp /tmp/scaletrain-llama8b-v5p64.tgz 'llama8b-v5p64:~/scaletrain.tgz' --worker=all" in setup[1]
    # TPU VM images have Python 3.10: a 3.11 venv beside it, the pinned stack inside.
    assert ("uv venv --quiet --allow-existing --python 3.11 ~/venv && ~/.local/bin/uv pip install --quiet "
            "--python ~/venv/bin/python -c constraints.txt -e . 'jax[tpu]==0.10.2'") in setup[2]
    sweep = _dry(capsys, "sweep", "v5p-64.yaml")
    assert len(sweep) == 5 and all("--worker=all" in line and "nohup" not in line for line in sweep)
    # The sweep's 5 steps plus a warm-up, no checkpoint, and a failed variant does not stop the rest.
    assert ("--set mesh.fsdp=16 --set mesh.tensor=2 --set steps=6 --set checkpoint.every_steps=7 --set "
            "run_dir=gs://my-bucket/scaletrain/llama8b-v5p64/sweep/fsdp=16_tensor=2 ") in sweep[1]
    assert sweep[1].endswith("|| echo 'variant fsdp=16_tensor=2 failed: see ~/llama8b-v5p64-fsdp=16_tensor=2.log'")


def test_two_v6e_256_slices(capsys):
    [create] = _dry(capsys, "create", "v6e-256x2.yaml")
    assert "--node-count=2 --node-prefix=llama70b-v6e --accelerator-type=v6e-256" in create
    coordinator, *runs = _dry(capsys, "run", "v6e-256x2.yaml")
    assert coordinator == ("COORDINATOR=$(gcloud compute tpus tpu-vm describe llama70b-v6e-0 "
                           "'--format=value(networkEndpoints[0].ipAddress)' --project=my-project --zone=us-east5-b)")
    assert len(runs) == 2
    for i, line in enumerate(runs):
        assert line.startswith(f"gcloud compute tpus tpu-vm ssh llama70b-v6e-{i} --worker=all --command=\"")
        # The launcher's shell fills in the coordinator; each slice gets its own id; DCN carries data parallelism.
        assert (f"MEGASCALE_COORDINATOR_ADDRESS=$COORDINATOR:8080 MEGASCALE_NUM_SLICES=2 MEGASCALE_SLICE_ID={i} "
                f"MEGASCALE_PORT=8080") in line
        assert "LIBTPU_INIT_ARGS=--xla_tpu_enable_async_collective_fusion=true" in line
        assert "--set mesh.dcn_data=2" in line
    job = yaml.safe_load(tpu.manifest(tpu.load(CONFIGS / "v6e-256x2.yaml")))
    [replicated] = job["spec"]["replicatedJobs"]
    pod = replicated["template"]["spec"]["template"]["spec"]
    assert replicated["replicas"] == 2 and replicated["template"]["spec"]["parallelism"] == 64
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "16x16"


def test_the_remote_command_reaches_the_worker_intact():
    """What bash hands gcloud as --command: quotes and $ kept, only $COORDINATOR filled in."""
    import subprocess

    line = tpu.line(["echo", "--command=cd ~/x && A='b c' B=$COORDINATOR:1 C=\"$HOME\" `d`"])
    out = subprocess.run(["bash", "-c", f"COORDINATOR=10.0.0.2; {line}"], capture_output=True, text=True).stdout
    assert out == "--command=cd ~/x && A='b c' B=10.0.0.2:1 C=\"$HOME\" `d`\n"


@pytest.mark.parametrize("change, says", [
    ({"accelerator": "v7z-16"}, "unknown accelerator 'v7z-16'"),
    ({"bucket": None}, "'bucket' is missing"),
    ({"slices": 0}, "slices=0; expected a positive integer"),
    ({"accelerator": "v5p-63"}, "expected an even number"),
    ({"bucket": "/local/dir"}, "is not a gs:// path"),
    ({"capacity": "cheap"}, "capacity 'cheap'"),
    ({"colour": "blue"}, "unknown key(s) colour"),
])
def test_bad_launch_files_exit_2_with_one_error_line(tmp_path, capsys, change, says):
    raw = yaml.safe_load((CONFIGS / "v5e-16.yaml").read_text())
    raw.update(change)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in raw.items() if v is not None}))
    assert tpu.main(["create", "--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and says in err and err.count("\n") == 1


def test_hosts_and_the_local_dry_run(capsys):
    assert [tpu.load(CONFIGS / f).hosts for f in ("v5e-16.yaml", "v5p-64.yaml", "v6e-256x2.yaml")] == [4, 8, 64]
    assert tpu.main(["run", "--config", str(CONFIGS / "v5e-16.yaml"), "--local", "2", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("train.py --config configs/llama3_1b.yaml" in x for x in lines)
    assert all("--cpu-devices 4 --coordinator localhost:" in x for x in lines)
    assert lines[0].endswith("--num-processes 2 --process-id 0") and lines[1].endswith("--process-id 1")


def test_run_locally_as_two_processes(tmp_path):
    """The run command's training command, as 2 CPU processes x 4 devices joined by jax.distributed."""
    sets = tiny_overrides(tmp_path / "unused", steps=3, **{"mesh.fsdp": -1})
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump({
        "project": "p", "zone": "z", "accelerator": "v5e-8", "bucket": "gs://b", "run_name": "local",
        "train": {"config": "configs/llama_tiny.yaml", "set": [s for s in sets if not s.startswith("run_dir=")]}}))
    assert tpu.main(["run", "--config", str(path), "--local", "2", "--run-dir", str(tmp_path / "run")]) == 0
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
