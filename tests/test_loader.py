"""Bad checkpoints fail with a clear error that names the problem."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specengine.models import CheckpointError, ConfigError, load_model


@pytest.fixture
def folder(checkpoint, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint("llama3-rope-gqa"), dst)
    return dst


def edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(folder):
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(folder)


def test_missing_weights(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(folder)


def test_pickled_weights_are_refused_not_loaded(folder):
    (folder / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: pickled weights are never loaded"):
        load_model(folder)


def test_unknown_architecture_names_the_supported_ones(folder):
    edit_config(folder, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ConfigError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM, MistralForCausalLM, "
                                          "Qwen2ForCausalLM, Qwen3ForCausalLM"):
        load_model(folder)


def test_weight_shape_not_matching_config(folder):
    edit_config(folder, vocab_size=98)
    with pytest.raises(CheckpointError, match=r"weight (lm_head|model.embed_tokens).weight has shape \(97, 64\) but the config implies \(98, 64\)"):
        load_model(folder)


def test_missing_weight_is_named(folder):
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing.*model.layers.1.mlp.up_proj.weight"):
        load_model(folder)


def test_unused_weight_is_named(folder):
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2)
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="not used.*model.layers.9.mlp.up_proj.weight"):
        load_model(folder)


def test_missing_shard_is_named(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(checkpoint("qwen2-qkv-bias")).save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"missing: {shard.name}"):
        load_model(tmp_path)


def test_unsupported_rope_type(folder):
    edit_config(folder, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(ConfigError, match="rope type 'yarn' is not supported; supported: default, linear, llama3"):
        load_model(folder)


def test_invalid_dtype(folder):
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        load_model(folder, dtype="int8")


def test_qwen_sliding_window_layers_are_refused(checkpoint, tmp_path):
    dst = tmp_path / "q"
    shutil.copytree(checkpoint("qwen2-qkv-bias"), dst)
    edit_config(dst, use_sliding_window=True, sliding_window=4)
    with pytest.raises(ConfigError, match="sliding-window layers is not supported"):
        load_model(dst)
