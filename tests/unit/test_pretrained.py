"""Pretrained weights read a part at a time (model/pretrained.py, issue 37): a skeleton holds no parameter but keeps
its ties and its buffers; a checkpoint is read only as far as asked, from safetensors or from an export."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from distsetup.formats.runconfig import ModelConfig
from distsetup.training.model import build as models
from distsetup.training.model.pretrained import Pretrained, covers, parameters_on_meta
from distsetup.training.model_setup import whole_model


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("positions", torch.arange(3.0), persistent=False)


def test_a_skeleton_holds_no_parameter_but_keeps_its_ties_and_builds_its_buffers():
    with parameters_on_meta():
        model = Tied()
    assert all(p.is_meta for p in model.parameters())
    assert model.head.weight is model.embed.weight
    assert torch.equal(model.positions, torch.arange(3.0))
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # outside it, as before


def test_a_checkpoint_is_read_only_as_far_as_asked(tmp_path):
    weights = {"embed.weight": torch.arange(40.0).reshape(10, 4)}
    (tmp_path / "hf").mkdir()
    save_file(weights, tmp_path / "hf" / "model.safetensors")
    torch.save(weights, tmp_path / "export.pt")
    with parameters_on_meta():
        model = Tied()
    sources = (Pretrained(tmp_path / "hf"), Pretrained(tmp_path / "hf" / "model.safetensors"))  # a folder, its file
    for source in (*sources, Pretrained(tmp_path / "export.pt")):
        assert covers(source, model)  # the tied head is the embedding: one parameter
        assert torch.equal(source.rows("embed.weight", 2, 5), weights["embed.weight"][2:5])
        assert source.bytes_read == 3 * 4 * 4
    with parameters_on_meta():
        wider = nn.Embedding(10, 5)
    assert not covers(Pretrained(tmp_path / "export.pt"), nn.ModuleDict({"embed": wider}))  # another shape
    # a buffer its constructor computes from a parameter (an anchor to the initial weights) is on the meta device in
    # a skeleton: the model is built whole on rank 0 (FSDP2 and ZeRO-3 stopped in a traceback copying out of meta)
    with parameters_on_meta():
        anchored = Tied()
        anchored.register_buffer("anchor", anchored.embed.weight.detach().clone())
    assert anchored.anchor.is_meta and not covers(Pretrained(tmp_path / "export.pt"), anchored)


def test_an_export_that_every_rank_reads_a_part_of_is_mapped_once(tmp_path, monkeypatch):
    """--init_from where the backend fills its shards from the file: the file is mapped once per rank, and its keys
    are still checked against the model."""
    m = ModelConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=16)
    torch.save(models.build(m).state_dict(), tmp_path / "export.pt")
    loads = []
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or load(*a, **k))
    backend = SimpleNamespace(fills_shards_from_rank0=True, reads_pretrained="its shards' rows")
    world = SimpleNamespace(is_main=True, size=2)
    model, source = whole_model(m, str(tmp_path / "export.pt"), models.describe(m), backend, world, print)
    assert source is not None and all(p.is_meta for p in model.parameters())
    assert len(loads) == 1


def test_checkpoint_export_s_safetensors_start_a_run_without_torch_load(tmp_path, monkeypatch):
    """--init_from the folder `distsetup checkpoint export` writes (its model.safetensors): torch.load reads
    safetensors only since torch 2.12, and the run failed after its set-up on older ones."""
    m = ModelConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=16)
    state = {name: tensor.clone() for name, tensor in models.build(m).state_dict().items()}
    save_file(state, tmp_path / "model.safetensors")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load of a safetensors file"))
    world = SimpleNamespace(is_main=True, size=2)
    for fills_shards in (True, False):  # FSDP2 and ZeRO-3 read parts; DDP's rank 0 loads it whole
        backend = SimpleNamespace(fills_shards_from_rank0=fills_shards, reads_pretrained="its shards' rows")
        model, source = whole_model(m, str(tmp_path / "model.safetensors"), models.describe(m), backend, world, print)
        if fills_shards:
            assert source is not None and all(p.is_meta for p in model.parameters())
            assert torch.equal(source.whole("lm_head.weight"), state["lm_head.weight"])
        else:
            assert source is None and all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_weights_with_two_values_for_a_tied_parameter_are_refused_and_one_value_passes(tmp_path):
    """An untied model's export loaded into a tied one: DDP kept the head's values, FSDP2 and ZeRO-3 the embedding's,
    without a word; a Hugging Face folder whose config ties what its weights do not crashed DDP (transformers unties
    it on rank 0 alone)."""
    from distsetup.errors import DistsetupError
    from distsetup.training.model.pretrained import check_ties, tied_names

    with parameters_on_meta():
        model = Tied()
    assert tied_names(model) == [["embed.weight", "head.weight"]]
    embedding = torch.randn(10, 4)
    for name, head in (("same", embedding.clone()), ("other", embedding + 1)):
        torch.save({"embed.weight": embedding, "head.weight": head}, tmp_path / f"{name}.pt")
        (tmp_path / name).mkdir()
        save_file({"embed.weight": embedding, "head.weight": head}, tmp_path / name / "model.safetensors")
    for same in (Pretrained(tmp_path / "same.pt"), Pretrained(tmp_path / "same")):
        check_ties(same, model, "the weights")
    for other in (Pretrained(tmp_path / "other.pt"), Pretrained(tmp_path / "other")):
        with pytest.raises(DistsetupError, match="holds different values for embed.weight and head.weight, which the"):
            check_ties(other, model, "the weights")
        assert other.bytes_read == 0  # a check, not a load: the figure of what each rank read stays its loads'
