"""Rank 0 alone builds the model's values, the other ranks build it on the meta device, and rank 0's values fill every
rank's part: FSDP2 and ZeRO-3 shard before anything is allocated whole (ZeRO-3 constructs its partitions inside
deepspeed.zero.Init), DDP and ZeRO 0-2 allocate their whole copies on the device. The initial weights are a
one-process run's, bit for bit; a weight tied by attribute stays one weight through training; every buffer,
persistent or not, is rank 0's."""

import json
import shutil

import pytest
import torch
import yaml
from repo import REPO
from train_runs import losses, train, write_config

from distsetup.formats.checkpoint_folder import latest_complete
from distsetup.training.checkpoint.export import consolidated_state_dict

SEED = 11
BALLAST_MIB = 512


ZERO3 = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 8}
ZERO3["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}  # no parameter always gathered
ZERO2 = {**ZERO3, "zero_optimization": {"stage": 2}}
BACKENDS = {"fsdp": ("fsdp", None), "zero3": ("deepspeed", ZERO3), "ddp": ("ddp", None), "zero2": ("deepspeed", ZERO2)}


def tied_run(folder, backend: str, steps: int, lr: float, args: list | None = None, model_args: dict | None = None):
    """A 2-process run of tests/support/tied_model.py (`args` given to the trainer, `model_args` to its builder);
    returns (its output folder, the build log's lines)."""
    result = tied_attempt(folder, backend, steps, lr, args, model_args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return folder / "out", (folder / "built.log").read_text().split("\n")[:-1]


def tied_attempt(folder, backend: str, steps: int, lr: float, args: list | None, model_args: dict | None):
    shutil.copy(REPO / "tests" / "support" / "tied_model.py", folder / "tied_model.py")
    training = {"max_steps": steps, "checkpoint_interval": steps, "log_interval": 1, "warmup_steps": 0, "lr": lr}
    training.update(seed=SEED, micro_batch_size=4, precision="fp32", grad_clip=1.0)
    config = write_config(folder, "tied", *BACKENDS[backend], training)
    run = yaml.safe_load(config.read_text())
    run["model"] = {"type": "python", "builder": "tied_model:build", "vocab_size": 64, "block_size": 32}
    run["model"]["args"] = model_args or {}
    config.write_text(yaml.safe_dump(run))
    return train(config, 2, *(args or []), env={"BUILT_LOG": str(folder / "built.log")}, timeout=120)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_only_rank0_builds_the_values_and_they_are_single_process_ones(tmp_path, backend):
    from tied_model import build  # tests/support is on pytest's path

    # DDP's copies take rank 0's buffers whatever their dtype or sharing: a float64 buffer, one two modules hold
    odd = {"odd_buffers": True} if backend == "ddp" else {}
    # an update of 1e-30 is below fp32's resolution at these weights: the checkpoint holds the initial ones
    # (the run config refuses lr 0)
    # a non-persistent buffer every block holds: FSDP2 broadcast rank 0's uninitialised copy of it to the second block
    model_args = {"checkpoint_ballast_mib": BALLAST_MIB, "shared_mask": True, **odd}
    out, built = tied_run(tmp_path, backend, steps=1, lr=1e-30, model_args=model_args)
    # rank 1 built it on the meta device only (and, under ZeRO-3, its partitions), never whole; rank 0 on the CPU
    assert {line.split()[1] for line in built if line.startswith("1 ")} == (
        {"meta", "partitioned"} if backend == "zero3" else {"meta"}
    ), built
    assert "0 cpu" in built, built
    torch.manual_seed(SEED)
    # the checkpoint holds the float64 buffer in the run's precision, fp32
    expected = {name: t.float() for name, t in build(**odd).state_dict().items()}
    saved = consolidated_state_dict(latest_complete(out / "checkpoints"))
    assert saved.keys() == expected.keys()
    for name, tensor in saved.items():  # the same values (a zero bias moved by the update's 1e-30 alone)
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-28, msg=name)
    assert "scale" in saved and len(losses(out)) == 1  # the forward checked the non-persistent buffer
    peaks = json.loads((out / "summary.json").read_text())["host_peak_bytes"]  # what benchmarks/scale_memory.py reads
    assert len(peaks["setup"]) == len(peaks["training"]) == 2
    assert all(peak > 0 for peak in peaks["setup"] + peaks["training"]), peaks
    # the checkpoint at the last step touched BALLAST_MIB more in state_dict(): no training peak counts it
    for setup, training in zip(peaks["setup"], peaks["training"], strict=True):
        assert training < setup + BALLAST_MIB * 2**20 / 2, peaks


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "zero3"])  # ZeRO-2 fills its copies as DDP does
def test_a_tied_weight_stays_one_weight_through_training_and_evaluation(tmp_path, backend):
    evaluating = ["data.val_fraction=0.01", "training.eval_interval=1"]
    out, built = tied_run(tmp_path, backend, steps=3, lr=3e-2, args=evaluating)
    saved = consolidated_state_dict(latest_complete(out / "checkpoints"))
    assert torch.equal(saved["head.weight"], saved["embed.weight"])
    curve = losses(out)
    assert len(curve) == 3 and curve[-1] < curve[0], curve
    # each training forward but the first follows an evaluation, whose forward ran no backward: ZeRO-3 holds no
    # parameter gathered from it
    gathered = [line.split()[1:] for line in built if line.startswith("gathered ")]
    assert sorted(gathered) == [["0", "0"]] * 3 + [["1", "0"]] * 3, gathered


def test_ranks_that_built_the_model_otherwise_stop_in_one_line(tmp_path):
    """Rank 0 builds its values on the CPU, the others on the meta device: a builder that builds other shapes on
    another rank is one line, not a hang."""
    refused = tied_attempt(tmp_path, "ddp", 1, 1e-30, None, {"wider_on_rank": 1})
    said = [line for line in refused.stderr.splitlines() if "built the model differently" in line]
    assert refused.returncode != 0 and said and "extra.weight" in said[0], refused.stderr[-3000:]


def test_zero3_from_an_export_reads_it_a_parameter_at_a_time_on_rank_0(tmp_path):
    """--init_from an export (every parameter in it): no rank builds the model with values; rank 0 reads one
    parameter at a time into DeepSpeed's gathered parameter (and the persistent buffer, as every rank does); the
    run starts from the export's weights, its tie kept and its non-persistent buffer built."""
    from tied_model import build

    torch.manual_seed(SEED + 1)
    pretrained = build().state_dict()
    pretrained["scale"] = torch.full((1,), 0.25)  # a persistent buffer unlike the one built
    torch.save(pretrained, tmp_path / "export.pt")
    # a non-persistent buffer every block holds: rank 0's copy of the skeleton stopped with a KeyError
    args = ["--init_from", tmp_path / "export.pt"]
    out, _ = tied_run(tmp_path, "zero3", steps=1, lr=1e-30, args=args, model_args={"shared_mask": True})
    saved = consolidated_state_dict(latest_complete(out / "checkpoints"))
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, pretrained[name], rtol=0, atol=1e-28, msg=name)
    assert torch.equal(saved["head.weight"], saved["embed.weight"])
    parameter_bytes = sum(t.numel() * 4 for name, t in pretrained.items() if name not in ("head.weight", "scale"))
    assert json.loads((out / "summary.json").read_text())["pretrained_read_bytes"] == [parameter_bytes + 4, 4]
