"""Checkpoint files written and read one tensor at a time (checkpoint/streamed_io.py) hold exactly what torch.save and
torch.distributed.checkpoint would have written of the whole state, and each lazy tensor is read once."""

import collections

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distsetup.training.checkpoint import streamed_io
from distsetup.training.checkpoint.streamed_io import (
    Lazy,
    MappedTorchFile,
    materialized,
    save_dcp_streamed,
    save_streamed,
)


@pytest.fixture
def small_maps(monkeypatch):
    """Memory maps dropped after a few hundred bytes: every read below goes through several of them."""
    monkeypatch.setattr(streamed_io, "MAPPED_BYTES", 256)


def counted(tensor: torch.Tensor, reads: collections.Counter, name: str) -> Lazy:
    def read() -> torch.Tensor:
        reads[name] += 1
        return tensor.clone()

    return Lazy(tuple(tensor.shape), tensor.dtype, read)


def training_state(reads: collections.Counter) -> dict:
    """A named state as a conversion has it: weights and moments lazy, steps and settings real."""
    generator = torch.Generator().manual_seed(0)
    weights = {
        "wte.weight": torch.randn(40, 8, generator=generator),
        "ln.bias": torch.randn(8, generator=generator).to(torch.bfloat16),
        "blocks.0.fc.weight": torch.randn(3, 5, 2, generator=generator),
    }
    return {
        "model": {
            **{name: counted(t, reads, name) for name, t in weights.items()},
            "mask": torch.tril(torch.ones(4, 4)),
        },
        "optimizer": {
            "state": {
                name: {
                    "step": torch.tensor(7.0),
                    "exp_avg": counted(t.float() * 0.1, reads, f"{name}.exp_avg"),
                    "exp_avg_sq": counted(t.float() ** 2, reads, f"{name}.exp_avg_sq"),
                }
                for name, t in weights.items()
            },
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": list(weights)}],
        },
        "scheduler": {"last_epoch": 7, "base_lrs": [3e-3], "lr_lambdas": [None]},
    }


def assert_same(got, expected):
    if isinstance(expected, dict):
        assert got.keys() == expected.keys()
        for key in expected:
            assert_same(got[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected) and all(assert_same(g, e) is None for g, e in zip(got, expected, strict=True))
    elif isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)
    else:
        assert got == expected


def test_a_streamed_torch_file_loads_as_torch_save_of_the_whole_state(tmp_path, small_maps):
    reads: collections.Counter = collections.Counter()
    state = training_state(reads)
    save_streamed(state, tmp_path / "state.pt")
    assert set(reads.values()) == {1}  # each lazy tensor read once
    expected = materialized(training_state(collections.Counter()))
    assert_same(torch.load(tmp_path / "state.pt", weights_only=True), expected)
    torch.save(expected, tmp_path / "whole.pt")
    assert_same(torch.load(tmp_path / "state.pt", weights_only=True), torch.load(tmp_path / "whole.pt"))


class Holder:
    """No container torch's pytree opens: its tensor would be written without its bytes."""

    def __init__(self):
        self.tensor = torch.ones(3)


def test_a_tensor_the_tree_walk_cannot_reach_is_refused_not_left_empty(tmp_path):
    with pytest.raises(ValueError, match="2 tensors written where 1 were given"):
        save_streamed({"model": {"w": torch.ones(2)}, "other": Holder()}, tmp_path / "state.pt")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no process group: one process, as meant
def test_a_streamed_dcp_folder_loads_as_dcp_save_of_the_whole_state(tmp_path):
    reads: collections.Counter = collections.Counter()
    state = training_state(reads)
    del state["scheduler"]
    save_dcp_streamed(state, tmp_path / "dcp")
    assert set(reads.values()) == {1}
    expected = materialized(training_state(collections.Counter()))
    del expected["scheduler"]
    target = {
        "model": {name: torch.zeros_like(t) for name, t in expected["model"].items()},
        "optimizer": {
            "state": {
                name: {key: torch.zeros_like(t) for key, t in moments.items()}
                for name, moments in expected["optimizer"]["state"].items()
            },
            "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": []}],
        },
    }
    dcp.load(target, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert_same(target, expected)


def test_a_mapped_file_reads_each_tensor_again_after_dropping_its_map(tmp_path, small_maps, monkeypatch):
    tensors = {f"t{i}": torch.arange(100, dtype=torch.float32) * i for i in range(10)}
    torch.save({"model": tensors, "scalar": torch.tensor(3.0)}, tmp_path / "state.pt")
    mapped = MappedTorchFile(tmp_path / "state.pt")
    maps = collections.Counter()
    load = mapped.load
    monkeypatch.setattr(mapped, "load", lambda: maps.update(["made"]) or load())
    for _ in range(2):
        for name, tensor in tensors.items():
            assert torch.equal(mapped.read(("model", name)), tensor)
            assert torch.equal(mapped.read(("model", name), slice(10, 20)), tensor[10:20])
    assert mapped.read(("scalar",)).item() == 3.0  # a 0-dim tensor reads whole
    assert maps["made"] >= 2 * 10  # each whole tensor (400 bytes) passes the 256: the next read maps anew


def test_tensors_sharing_a_storage_are_written_each_whole(tmp_path):
    weight = torch.randn(6, 4)
    state = {"model": {"wte.weight": weight, "lm_head.weight": weight, "row": weight[2]}}  # tied, and a view
    save_streamed(state, tmp_path / "state.pt")
    back = torch.load(tmp_path / "state.pt", weights_only=True)["model"]
    assert all(torch.equal(back[name], tensor) for name, tensor in state["model"].items())


def test_a_zero0_file_with_an_int_adam_step_is_read_by_name(tmp_path):
    """DeepSpeed's FusedAdam (a ZeRO-0 run's optimizer on a GPU) counts its step in an int."""
    from distsetup.training.checkpoint.named_state import named_state

    weight, bias = torch.randn(4, 3), torch.randn(3)
    moments = {"step": 5, "exp_avg": torch.ones(4, 3), "exp_avg_sq": torch.ones(4, 3) * 2}
    torch.save(
        {
            "module": {"fc.weight": weight, "fc.bias": bias, "mask": torch.tensor(1.0)},
            "optimizer": {
                "state": {0: moments, 1: {"step": 5, "exp_avg": bias * 0, "exp_avg_sq": bias * 0}},
                "param_groups": [{"lr": 1e-3, "params": [0]}, {"lr": 1e-3, "params": [1]}],
            },
            "lr_scheduler": {"last_epoch": 5},
        },
        tmp_path / "mp_rank_00_model_states.pt",
    )
    state = named_state(tmp_path, "zero0", [["fc.weight"], ["fc.bias"]])
    assert torch.equal(state["model"]["fc.weight"], weight) and state["model"]["mask"].item() == 1.0
    assert state["optimizer"]["state"]["fc.weight"]["step"] == 5
    assert torch.equal(state["optimizer"]["state"]["fc.weight"]["exp_avg_sq"], moments["exp_avg_sq"])
    assert [group["params"] for group in state["optimizer"]["param_groups"]] == [["fc.weight"], ["fc.bias"]]
    assert state["scheduler"] == {"last_epoch": 5}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no process group: one process, as meant
def test_an_fsdp_checkpoint_read_a_tensor_at_a_time_reads_each_folders_metadata_once(tmp_path, monkeypatch):
    """Bug: each tensor's dcp.load read its folder's .metadata again (every tensor's place: megabytes for a model of
    thousands of tensors), so export, convert and a resume under ZeRO took time quadratic in the tensors (a 256-expert
    MoE's 2,071: 4 minutes to export)."""
    from torch.distributed.checkpoint import FileSystemReader

    from distsetup.training.checkpoint.named_state import lazy_state

    names = [f"layer{i}.weight" for i in range(30)]
    weights = {name: torch.full((3,), float(i)) for i, name in enumerate(names)}
    moments = {name: {"step": torch.tensor(2.0), "exp_avg": w + 1, "exp_avg_sq": w + 2} for name, w in weights.items()}
    dcp.save(weights, checkpoint_id=tmp_path / "model", no_dist=True)
    optimizer = {"state": moments, "param_groups": [{"lr": 0.1, "params": names}]}
    dcp.save(optimizer, checkpoint_id=tmp_path / "optim", no_dist=True)
    torch.save({"scheduler": {"last_epoch": 2}}, tmp_path / "scheduler.pt")
    reads = collections.Counter()
    read_metadata = FileSystemReader.read_metadata
    monkeypatch.setattr(
        FileSystemReader,
        "read_metadata",
        lambda self, *a, **k: reads.update([self.path]) or read_metadata(self, *a, **k),
    )
    state = materialized(lazy_state(tmp_path, "fsdp", [names]))
    assert all(torch.equal(state["model"][name], weights[name]) for name in names)
    assert all(torch.equal(state["optimizer"]["state"][name]["exp_avg_sq"], weights[name] + 2) for name in names)
    assert sorted(reads.values()) == [1, 1], reads  # model/ and optim/, whatever the number of tensors
