import pytest
import yaml

from scaletrain import config
from scaletrain.errors import ConfigError
from tests.conftest import ROOT


def test_defaults_validate_and_configs_load():
    config.validate(config.defaults())
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = config.load(path)
        assert cfg.model.num_heads % cfg.model.num_kv_heads == 0, path


def test_yaml_then_set_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 7\nmodel:\n  d_model: 96\noptim:\n  learning_rate: 3e-4\n")
    cfg = config.load(path, ["model.d_model=64", "mesh.fsdp=-1", "optim.learning_rate=1e-3", "run_dir=runs/x"])
    assert cfg.steps == 7 and cfg.model.d_model == 64 and cfg.mesh.fsdp == -1 and cfg.run_dir == "runs/x"
    assert cfg.optim.learning_rate == pytest.approx(1e-3)
    assert isinstance(cfg.optim.learning_rate, float)


def test_unknown_key_names_the_closest_valid_key(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'mesh.fdsp'; did you mean 'mesh.fsdp'"):
        config.load(None, ["mesh.fdsp=4"])
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  num_layer: 2\n")
    with pytest.raises(ConfigError, match="did you mean 'model.num_layers'"):
        config.load(path)


@pytest.mark.parametrize("override, message", [
    ("steps=abc", "steps must be a number"),
    ("steps=1.5", "steps must be a number \\(integer\\)"),
    ("model.tie_embeddings=3", "must be a bool"),
    ("steps=0", "steps must be > 0"),
    ("optim.b2=1.5", "must be in \\[0, 1\\]"),
    ("mesh.data=-2", "positive degree or -1"),
    ("remat.policy=some", "must be one of none, full, save_dots, save_qkv_proj"),
    ("remat.custom.query_proj=disk", "must be one of remat, device, offload"),
    ("model.num_kv_heads=3", "multiple of model.num_kv_heads"),
    ("train.grad_accum_steps=3", "divisible by train.grad_accum_steps"),
    ("steps", "expects KEY=VALUE"),
    ("optim.learning_rate=nan", "must be a finite number"),
    ("seed=4294967296", "seed must be < 2\\*\\*32"),
    ("run_dir=", "run_dir must name a directory"),
    ("model.vocab_size=100000000000", "model.vocab_size must be <= 2\\*\\*31 - 1 = 2147483647 \\(the largest int32"),
    ("mesh.data=" + "1" + "0" * 30, "mesh.data must be <= 2\\*\\*31 - 1"),
    ("train.global_batch=1073741824", "train.global_batch x data.seq_len = 1073741824 x 256 = 274877906944 tokens "
                                      "a step, over 2\\*\\*31 - 1"),
    ("optim.learning_rate=1e39", "optim.learning_rate must be <= 3.403e\\+38 \\(the largest float32"),
    ("train.spike.factor=1", "train.spike.factor must be > 1"),
    ("train.spike.action=restart", "train.spike.action must be one of off, warn, skip, rollback"),
    ("train.spike.window=0", "train.spike.window must be > 0"),
    # 0 would dump the stacks (and with train.hang.exit, exit) in the first phase to take half a second.
    ("train.hang.seconds=0", "train.hang.seconds must be > 0"),
    # A dense model has no experts: the run would train unquantized without a word.
    ("model.quantization=int8 model.quantized_matmuls=experts",
     "model.quantized_matmuls=experts on a dense model \\(model.num_experts=0\\) quantizes nothing"),
    ("model.quantization=int8 model.quantized_matmuls=experts,experts",
     "model.quantized_matmuls=experts,experts on a dense model \\(model.num_experts=0\\) quantizes nothing"),
])
def test_bad_values_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        config.load(None, override.split())


def test_resolved_config_round_trips(tmp_path):
    cfg = config.load(ROOT / "configs" / "llama_tiny.yaml", ["steps=3"])
    text = config.to_yaml(cfg)
    assert yaml.safe_load(text)["steps"] == 3
    (tmp_path / "resolved.yaml").write_text(text)
    assert config.load(tmp_path / "resolved.yaml").to_dict() == cfg.to_dict()


def test_missing_config_file():
    with pytest.raises(ConfigError, match="not found"):
        config.load("configs/nope.yaml")


@pytest.mark.parametrize("content, byte", [(bytes(range(256)), 128), (b"steps: 5\nrun_dir: caf\xe9\n", 21)])
def test_a_file_that_is_not_utf8_is_one_config_error(tmp_path, content, byte):
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=f"config file '{path}' is not UTF-8 text \\(byte {byte}\\)"):
        config.load(path)


def test_sizes_whose_arrays_could_not_be_counted_are_refused():
    """Each size fits int32, but a layer's attention scores would hold over 2**52 elements: XLA's int64 byte
    counts of such arrays, summed over a step, could overflow."""
    with pytest.raises(ConfigError, match=r"^train.global_batch x model.num_heads x data.seq_len x data.seq_len = "
                                          r"1 x 4 x 1073741824 x 1073741824 = 4.61e\+18 elements in a layer's "
                                          r"attention scores, over the 2\*\*52"):
        config.load(None, ["train.global_batch=1", "data.seq_len=1073741824"])
    config.load(None, ["train.global_batch=1", "data.seq_len=1073741824", "model.attention_block=1"])


def test_an_absurd_size_is_one_error_line_on_the_command_line(capsys):
    from scaletrain.__main__ import main

    assert main(["plan", "--config", str(ROOT / "configs" / "llama_tiny.yaml"), "--hardware", "v5p:2x2x1", "--set",
                 "model.vocab_size=100000000000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model.vocab_size must be <=") and err.count("\n") == 1
