"""A tiny Llama built locally from LlamaConfig trains under FSDP2, sharded per LlamaDecoderLayer."""

import json

import pytest
import yaml
from train_runs import FSDP_FILES, losses, train

pytest.importorskip("transformers")


def write_llama(folder):
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ).save_pretrained(folder)


def write_config(tmp_path, layer_cls: str):
    write_llama(tmp_path / "llama")
    fsdp = {**FSDP_FILES["fsdp_full"], "fsdp_transformer_layer_cls_to_wrap": layer_cls}
    (tmp_path / "fsdp.json").write_text(json.dumps(fsdp))
    config = {
        "model": {"type": "hf", "hf_path": str(tmp_path / "llama"), "block_size": 32},
        "data": {"num_samples": 1024},
        "training": {
            "micro_batch_size": 8,
            "max_steps": 30,
            "warmup_steps": 3,
            "lr": 3e-3,
            "log_interval": 1,
            "checkpoint_interval": 30,
            "output_dir": str(tmp_path / "out"),
        },
        "distributed": {"backend": "fsdp", "fsdp_config": str(tmp_path / "fsdp.json")},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "config.yaml"


@pytest.mark.slow
def test_tiny_llama_trains_under_fsdp(tmp_path):
    result = train(write_config(tmp_path, "LlamaDecoderLayer"), 2)
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(tmp_path / "out")
    assert len(curve) == 30 and curve[-1] < curve[0] - 0.3, curve
    assert (tmp_path / "out" / "checkpoints" / "step_0000030" / "COMPLETE").exists()
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["backend"] == "fsdp"


def test_unknown_layer_class_is_an_error(tmp_path):
    result = train(write_config(tmp_path, "NoSuchLayer"), 1)
    assert result.returncode != 0 and "no module of class NoSuchLayer" in result.stderr
