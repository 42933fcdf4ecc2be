"""ZeRO's buffers and the model (issue 37: DeepSpeed's defaults, a 5e8-element reduce bucket, are 2 GB in fp32 on
every rank whatever the model; issue 38: sized from the hidden size, ZeRO-3 runs 8-16% slower on an H200 and the HF
Trainer's small-model CPU step 25% faster): what a DeepSpeed file leaves unset keeps DeepSpeed's sizes where a rank
has room for them, and is sized from the hidden size as the HF integration's "auto" does where it has not, but for
ZeRO-3's sub_group_size, which shapes its checkpoints; what the file sets stays; `distsetup plan` decides alike."""

import json

import pytest
import torch

from distsetup.formats.deepspeed import DEEPSPEED_DEFAULTS, MODEL_SIZED, SIZED_BY_ROOM, model_sized, unset_sizes
from distsetup.formats.runconfig_load import load_run_config
from distsetup.planning.estimates import (
    BY_KEY,
    Hardware,
    device_state,
    keeps_deepspeed_sizes,
    model_states,
    room_for_deepspeed_buffers,
)
from distsetup.planning.models import ModelShape
from distsetup.planning.units import GB
from distsetup.training import memory
from distsetup.training.backends.deepspeed import DeepSpeedBackend
from distsetup.training.launch_env import World

BATCH = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2}
GPT = ["model.n_layer=1", "model.n_embd=48", "model.n_head=2", "model.block_size=8"]
PARAMETERS = 10**6  # the model's size as the trainer passes it: what matters is the state and buffers against memory
ONE = World(rank=0, local_rank=0, size=1, local_size=1)
# a ZeRO-3 fp32 rank of one process: its state, and DeepSpeed's sizes beside it (the 5e8 reduce bucket and the whole
# model gathered) in half its memory
STATE = device_state(model_states(BY_KEY["zero3"], ModelShape(PARAMETERS), Hardware(runtime_bytes=0), "fp32"))
ROOM = int(2 * (STATE + 4 * (500_000_000 + PARAMETERS)))


def backend_for(tmp_path, monkeypatch, zero: dict, model: list[str], memory_bytes: int = 0) -> DeepSpeedBackend:
    """The DeepSpeed backend of one process fitted to `model` on a CPU of `memory_bytes` (0: no room at all)."""
    (tmp_path / "ds.json").write_text(json.dumps({**BATCH, "zero_optimization": zero}))
    chosen = ["distributed.backend=deepspeed", f"distributed.deepspeed_config={tmp_path / 'ds.json'}"]
    cfg = load_run_config(None, [*model, "training.micro_batch_size=2", *chosen])
    backend = DeepSpeedBackend(cfg, ONE, torch.device("cpu"))
    monkeypatch.setattr(memory, "device_memory_per_rank", lambda device, local_processes: memory_bytes)
    backend.fit_to_the_model(PARAMETERS)
    return backend


def test_what_the_file_leaves_unset_is_sized_from_the_hidden_size_where_deepspeeds_sizes_leave_no_room(
    tmp_path, monkeypatch
):
    backend = backend_for(tmp_path, monkeypatch, {"stage": 3}, GPT, memory_bytes=ROOM - 1)
    zero = backend.ds_config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 48 * 48
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 48 * 48)
    assert zero["stage3_param_persistence_threshold"] == 10 * 48
    # kept gathered: two blocks' worth (12 h^2 each); kept for the next use: one block's, not DeepSpeed's 1e9
    assert zero["stage3_max_live_parameters"] == 24 * 48 * 48
    assert zero["stage3_max_reuse_distance"] == 12 * 48 * 48
    assert zero["sub_group_size"] == 12 * 48 * 48  # the optimizer's flat copy of the gradients: a block's at most
    assert any("hidden size 48 (no room" in note for note in backend.notes), backend.notes


def test_deepspeeds_own_sizes_stay_where_the_rank_has_room_for_them_but_the_checkpoints_sub_groups(
    tmp_path, monkeypatch
):
    """A file that leaves the buffers unset means DeepSpeed's sizes to DeepSpeed and the HF Trainer: the trainer
    reads it so wherever they fit. ZeRO-3's sub_group_size, which shapes the optimizer's partitions in its checkpoint,
    is the hidden size's wherever the run is, so that a resume on another machine loads it."""
    backend = backend_for(tmp_path, monkeypatch, {"stage": 3}, GPT, memory_bytes=ROOM)
    assert backend.ds_config["zero_optimization"] == {"stage": 3, "sub_group_size": 12 * 48 * 48}
    assert set(SIZED_BY_ROOM) == set(MODEL_SIZED) - {"sub_group_size"}
    stage2 = backend_for(tmp_path, monkeypatch, {"stage": 2}, GPT, memory_bytes=10**12)
    assert stage2.ds_config["zero_optimization"] == {"stage": 2} and not stage2.notes


def test_room_counts_the_state_and_deepspeeds_buffers_in_half_the_memory():
    P = PARAMETERS
    assert room_for_deepspeed_buffers(3, P, STATE, ROOM, 4) and not room_for_deepspeed_buffers(3, P, STATE, ROOM - 1, 4)
    assert room_for_deepspeed_buffers(3, P, STATE / 2, ROOM // 2, 2)  # 16-bit state and buffers take half the bytes
    # the gathered model counts at most 1e9 elements (DeepSpeed's stage3_max_live_parameters)
    assert room_for_deepspeed_buffers(3, 10**10, 0, 2 * 4 * (500_000_000 + 10**9), 4)
    # ZeRO 1-2: two reduce buckets (overlap_comm's second), no gathered model
    assert room_for_deepspeed_buffers(2, 10**10, 0, 2 * 4 * 2 * 500_000_000, 4)
    assert not room_for_deepspeed_buffers(2, 10**10, 0, 2 * 4 * 2 * 500_000_000 - 1, 4)


DEEPSPEED_STRATEGIES = ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload_optimizer", "zero3_offload_all"]


@pytest.mark.parametrize("key", DEEPSPEED_STRATEGIES)
@pytest.mark.parametrize("gigabytes", [4, 8, 16, 80])
def test_the_trainer_and_the_plan_decide_alike(tmp_path, monkeypatch, key, gigabytes):
    """For each DeepSpeed strategy (offloaded states left out of the GPU's) and memory, the trainer keeps DeepSpeed's
    sizes exactly where `distsetup plan` counts them: the same function, on the same figures."""
    strategy = BY_KEY[key]
    world = World(rank=0, local_rank=0, size=8, local_size=8)
    zero = {"stage": strategy.zero_stage}
    if strategy.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if strategy.offload_param:
        zero["offload_param"] = {"device": "cpu"}
    (tmp_path / "ds.json").write_text(json.dumps({**BATCH, "train_batch_size": 16, "zero_optimization": zero}))
    chosen = ["distributed.backend=deepspeed", f"distributed.deepspeed_config={tmp_path / 'ds.json'}"]
    cfg = load_run_config(
        None, ["model.n_embd=2048", "training.micro_batch_size=2", "training.precision=bf16", *chosen]
    )
    backend = DeepSpeedBackend(cfg, world, torch.device("cpu"))
    assert backend.memory_strategy == key
    monkeypatch.setattr(memory, "device_memory_per_rank", lambda device, local_processes: gigabytes * GB)
    backend.fit_to_the_model(10**9)
    kept = backend.ds_config["zero_optimization"].get("reduce_bucket_size") is None
    hardware = Hardware(gpus_per_node=8, gpu_memory=gigabytes * GB)
    assert kept == keeps_deepspeed_sizes(strategy, ModelShape(10**9, hidden_size=2048), hardware, "bf16")


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
    strategy = BY_KEY[key]
    shaped, unshaped = ModelShape(params=10**9, hidden_size=2048), ModelShape(params=10**9)
    roomy, tight = Hardware(runtime_bytes=0), Hardware(runtime_bytes=0, gpu_memory=16 * GB)
    sized, default, unknown = (
        model_states(strategy, shaped, tight, "bf16"),
        model_states(strategy, shaped, roomy, "bf16"),
        model_states(strategy, unshaped, tight, "bf16"),
    )
    assert keeps_deepspeed_sizes(strategy, shaped, roomy, "bf16")
    assert not keeps_deepspeed_sizes(strategy, shaped, tight, "bf16")
    assert default["buffers"] == unknown["buffers"]  # DeepSpeed's own, where there is room or no hidden size
    if key == "zero3":  # the prefetch bucket and the reduce bucket (allocated whole)
        assert sized["buffers"] == 2 * (model_sized("stage3_prefetch_bucket_size", 2048) + 2048**2)
        assert default["buffers"] == 2 * (DEEPSPEED_DEFAULTS["stage3_prefetch_bucket_size"] + 500_000_000)
    else:
        assert sized["buffers"] < default["buffers"]


def test_distsetup_deepspeed_sizes_the_buffers_for_a_hidden_size_it_is_given(run_cli, tmp_path):
    """`--hidden_size` sizes what the flags leave unset, as the trainer does where DeepSpeed's own sizes leave no room;
    what they set stays; a stage's file gets only its own stage's keys."""
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
    # beside --hf_auto too: "auto" there needs a transformers model's config, which a user's own module lacks
    result = run_cli("deepspeed", "--zero_stage", "3", "--hf_auto", "--hidden_size", "48", "--output", out)
    assert result.exit_code == 0, result.output
    zero = json.loads(out.read_text())["zero_optimization"]
    assert {key: zero[key] for key in MODEL_SIZED} == unset_sizes({"stage": 3}, 48)
