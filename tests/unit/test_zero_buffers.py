"""ZeRO's buffers sized for the model (issue: DeepSpeed's defaults, a 5e8-element reduce bucket, are 2 GB in fp32 on
every rank whatever the model): what a DeepSpeed file leaves unset, the trainer sizes from the hidden size as the HF
integration's "auto" does; what the file sets stays; `distsetup plan` counts the same buffers."""

import json

import pytest
import torch

from distsetup.formats.deepspeed import MODEL_SIZED, model_sized, unset_sizes
from distsetup.formats.runconfig_load import load_run_config
from distsetup.planning.estimates import DS_PREFETCH_BUCKET, STRATEGIES, Hardware, model_states
from distsetup.planning.models import ModelShape
from distsetup.training.backends.deepspeed import DeepSpeedBackend
from distsetup.training.launch_env import World

BATCH = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2}


def backend_for(tmp_path, zero: dict, model: list[str]) -> DeepSpeedBackend:
    (tmp_path / "ds.json").write_text(json.dumps({**BATCH, "zero_optimization": zero}))
    chosen = ["distributed.backend=deepspeed", f"distributed.deepspeed_config={tmp_path / 'ds.json'}"]
    cfg = load_run_config(None, [*model, "training.micro_batch_size=2", *chosen])
    return DeepSpeedBackend(cfg, World(rank=0, local_rank=0, size=1, local_size=1), torch.device("cpu"))


GPT = ["model.n_layer=1", "model.n_embd=48", "model.n_head=2", "model.block_size=8"]


def test_what_the_file_leaves_unset_is_sized_from_the_hidden_size(tmp_path):
    backend = backend_for(tmp_path, {"stage": 3}, GPT)
    zero = backend.ds_config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 48 * 48
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 48 * 48)
    assert zero["stage3_param_persistence_threshold"] == 10 * 48
    # kept gathered: two blocks' worth (12 h^2 each); kept for the next use: one block's, not DeepSpeed's 1e9
    assert zero["stage3_max_live_parameters"] == 24 * 48 * 48
    assert zero["stage3_max_reuse_distance"] == 12 * 48 * 48
    assert zero["sub_group_size"] == 12 * 48 * 48  # the optimizer's flat copy of the gradients: a block's at most
    assert any("hidden size 48" in note for note in backend.notes), backend.notes


def test_what_the_file_sets_stays_and_stage_3_keys_stay_out_of_stage_2(tmp_path):
    zero = backend_for(tmp_path, {"stage": 2, "reduce_bucket_size": 123456}, GPT).ds_config["zero_optimization"]
    assert zero == {"stage": 2, "reduce_bucket_size": 123456}
    assert unset_sizes({"stage": 2}, 48) == {"reduce_bucket_size": 48 * 48}
    assert unset_sizes({"stage": 0}, 48) == {}


def test_a_hugging_face_folder_gives_its_hidden_size_and_a_python_model_none(tmp_path):
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "vocab_size": 256}))
    hf = backend_for(tmp_path, {"stage": 1}, ["model.type=hf", f"model.hf_path={folder}"])
    assert hf.ds_config["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    own = backend_for(tmp_path, {"stage": 3}, ["model.type=python", "model.builder=torch.nn:Linear"])
    assert own.ds_config["zero_optimization"] == {"stage": 3}  # unknown hidden size: DeepSpeed's defaults


@pytest.mark.parametrize("key", ["zero3", "zero2"])
def test_the_planner_counts_the_buffers_the_trainer_sizes(key):
    (strategy,) = [s for s in STRATEGIES if s.key == key]
    shaped, unshaped = ModelShape(params=10**9, hidden_size=2048), ModelShape(params=10**9)
    hardware = Hardware(runtime_bytes=0)
    sized, default = (
        model_states(strategy, shaped, hardware, "bf16"),
        model_states(strategy, unshaped, hardware, "bf16"),
    )
    if key == "zero3":
        assert sized["buffers"] == 2 * model_sized("stage3_prefetch_bucket_size", 2048)
        assert default["buffers"] == 2 * DS_PREFETCH_BUCKET
    else:
        assert sized["buffers"] < default["buffers"]
    assert set(MODEL_SIZED) >= {"reduce_bucket_size", "stage3_prefetch_bucket_size"}


def test_distsetup_deepspeed_sizes_the_buffers_for_a_hidden_size_it_is_given(run_cli, tmp_path):
    """`--hidden_size` sizes what the flags leave unset, as the trainer would; what they set stays; a stage's file
    gets only its own stage's keys."""
    out = tmp_path / "ds.json"
    given = ["--zero_stage", "3", "--hidden_size", "48", "--reduce_bucket_size", "1000", "--output", out]
    result = run_cli("deepspeed", *given, "--micro_batch_size", "2")
    assert result.exit_code == 0, result.output
    zero = json.loads(out.read_text())["zero_optimization"]
    assert {key: zero[key] for key in MODEL_SIZED} == {**unset_sizes({"stage": 3}, 48), "reduce_bucket_size": 1000}
    result = run_cli("deepspeed", "--zero_stage", "2", "--hidden_size", "48", "--output", tmp_path / "ds2.json")
    assert result.exit_code == 0, result.output
    zero = json.loads((tmp_path / "ds2.json").read_text())["zero_optimization"]
    assert zero["reduce_bucket_size"] == 48 * 48 and not any(key.startswith("stage3_") for key in zero)
