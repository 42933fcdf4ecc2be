"""ZeRO's buffers and the model (issue 37: DeepSpeed's defaults, a 5e8-element reduce bucket, are 2 GB in fp32 on
every rank whatever the model; issue 38: sized from the hidden size, ZeRO-3 runs at 0.44 of the plain step on an H200
against 0.64 at DeepSpeed's sizes): what a DeepSpeed file leaves unset keeps DeepSpeed's sizes where the rank has room
for them, and is sized from the hidden size as the HF integration's "auto" does where it has not; what the file sets
stays; `distsetup plan` counts the same buffers by the same rule."""

import json

import pytest
import torch

from distsetup.formats.deepspeed import MODEL_SIZED, model_sized, unset_sizes
from distsetup.formats.runconfig_load import load_run_config
from distsetup.planning.estimates import (
    DS_PREFETCH_BUCKET,
    STRATEGIES,
    Hardware,
    model_states,
    room_for_deepspeed_buffers,
)
from distsetup.planning.models import ModelShape
from distsetup.planning.units import GB
from distsetup.training import memory
from distsetup.training.backends.deepspeed import DeepSpeedBackend
from distsetup.training.launch_env import World
from distsetup.training.model.build import training_state_bytes

BATCH = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2}


def backend_for(tmp_path, monkeypatch, zero: dict, model: list[str], free_bytes: int = 0) -> DeepSpeedBackend:
    """The DeepSpeed backend of one process fitted to `model` on a CPU with `free_bytes` free (0: no room at all)."""
    (tmp_path / "ds.json").write_text(json.dumps({**BATCH, "zero_optimization": zero}))
    chosen = ["distributed.backend=deepspeed", f"distributed.deepspeed_config={tmp_path / 'ds.json'}"]
    cfg = load_run_config(None, [*model, "training.micro_batch_size=2", *chosen])
    backend = DeepSpeedBackend(cfg, ONE, torch.device("cpu"))
    monkeypatch.setattr(memory, "free_bytes_per_rank", lambda device, local_processes: free_bytes)
    backend.fit_to_the_model(PARAMETERS)
    return backend


GPT = ["model.n_layer=1", "model.n_embd=48", "model.n_head=2", "model.block_size=8"]
PARAMETERS = 10**6  # the model's size as the trainer passes it: what matters is the state and buffers against memory
ONE = World(rank=0, local_rank=0, size=1, local_size=1)
STATE = training_state_bytes("zero3", PARAMETERS, ONE, "fp32")  # as `distsetup plan` counts it
# DeepSpeed's sizes beside it: a 5e8 reduce bucket, the prefetch bucket and the gathered model (the whole, 1e6), in
# half the free memory
ROOM = int(2 * (STATE + 4 * (500_000_000 + 2 * PARAMETERS)))


def test_what_the_file_leaves_unset_is_sized_from_the_hidden_size_where_deepspeeds_sizes_leave_no_room(
    tmp_path, monkeypatch
):
    backend = backend_for(tmp_path, monkeypatch, {"stage": 3}, GPT, free_bytes=ROOM - 1)
    zero = backend.ds_config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 48 * 48
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 48 * 48)
    assert zero["stage3_param_persistence_threshold"] == 10 * 48
    # kept gathered: two blocks' worth (12 h^2 each); kept for the next use: one block's, not DeepSpeed's 1e9
    assert zero["stage3_max_live_parameters"] == 24 * 48 * 48
    assert zero["stage3_max_reuse_distance"] == 12 * 48 * 48
    assert zero["sub_group_size"] == 12 * 48 * 48  # the optimizer's flat copy of the gradients: a block's at most
    assert any("hidden size 48" in note and "no room for DeepSpeed's defaults" in note for note in backend.notes)


def test_deepspeeds_own_sizes_stay_where_the_rank_has_room_for_them(tmp_path, monkeypatch):
    """A file that leaves the buffers unset means DeepSpeed's sizes to DeepSpeed and the HF Trainer: the trainer
    reads it so wherever they fit, and says nothing."""
    backend = backend_for(tmp_path, monkeypatch, {"stage": 3}, GPT, free_bytes=ROOM)
    assert backend.ds_config["zero_optimization"] == {"stage": 3}
    assert not any("hidden size" in note for note in backend.notes), backend.notes


def test_room_counts_the_state_and_deepspeeds_buffers_in_half_the_free_memory():
    P = PARAMETERS
    assert room_for_deepspeed_buffers(P, STATE, ROOM, 4) and not room_for_deepspeed_buffers(P, STATE, ROOM - 1, 4)
    assert not room_for_deepspeed_buffers(P, STATE, ROOM // 2, 4)
    assert room_for_deepspeed_buffers(P, STATE / 2, ROOM // 2, 2)  # 16-bit state and buffers take half the bytes
    # the gathered model counts at most 1e9 elements (DeepSpeed's stage3_max_live_parameters)
    assert room_for_deepspeed_buffers(10**10, 0, 2 * 4 * (500_000_000 + 50_000_000 + 10**9), 4)


def test_what_the_file_sets_stays_and_stage_3_keys_stay_out_of_stage_2(tmp_path, monkeypatch):
    backend = backend_for(tmp_path, monkeypatch, {"stage": 2, "reduce_bucket_size": 123456}, GPT)
    zero = backend.ds_config["zero_optimization"]
    assert zero == {"stage": 2, "reduce_bucket_size": 123456}
    assert unset_sizes({"stage": 2}, 48) == {"reduce_bucket_size": 48 * 48}
    assert unset_sizes({"stage": 0}, 48) == {}


def test_a_hugging_face_folder_gives_its_hidden_size_and_a_python_model_none(tmp_path, monkeypatch):
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "vocab_size": 256}))
    hf = backend_for(tmp_path, monkeypatch, {"stage": 1}, ["model.type=hf", f"model.hf_path={folder}"])  # no room
    assert hf.ds_config["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    own = backend_for(tmp_path, monkeypatch, {"stage": 3}, ["model.type=python", "model.builder=torch.nn:Linear"])
    assert own.ds_config["zero_optimization"] == {"stage": 3}  # unknown hidden size: DeepSpeed's defaults


@pytest.mark.parametrize("key", ["zero3", "zero2"])
def test_the_planner_counts_the_buffers_the_trainer_sizes(key):
    """A 1B model's ZeRO state beside DeepSpeed's buffers fits half of an 80 GB GPU but not of a 16 GB one: the plan
    counts DeepSpeed's sizes on the first, the hidden size's on the second, as the trainer fills them."""
    (strategy,) = [s for s in STRATEGIES if s.key == key]
    shaped, unshaped = ModelShape(params=10**9, hidden_size=2048), ModelShape(params=10**9)
    roomy, tight = Hardware(runtime_bytes=0), Hardware(runtime_bytes=0, gpu_memory=16 * GB)
    sized, default, unknown = (
        model_states(strategy, shaped, tight, "bf16"),
        model_states(strategy, shaped, roomy, "bf16"),
        model_states(strategy, unshaped, tight, "bf16"),
    )
    assert default["buffers"] == unknown["buffers"]  # DeepSpeed's own, where there is room or no hidden size
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
