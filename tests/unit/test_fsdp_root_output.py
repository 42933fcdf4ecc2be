"""FSDP2's root returns what the user's model returns, and a model that returns a view (a scorer ending in
`squeeze(-1)`, as examples/pairwise_scorer does; blocks that return one, as a Hugging Face Switch Transformer's) is
normal: the trainer hands the view on as a tensor that is no view
(no copy), so FSDP2 has nothing to warn of, and an in-place op on the output keeps FSDP2's pre-backward hook and the
gradients of the model without FSDP2. One process in a gloo group (FSDP2's hooks run as on many)."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from repo import free_port

from distsetup.formats.runconfig_load import load_run_config
from distsetup.training.backends.fsdp import FSDPBackend
from distsetup.training.launch_env import World
from distsetup.training.model.build import ModelParts

VIEW_WARNING = "returned a view tensor"


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


class Block(nn.Module):
    """A unit that returns a view, as a Hugging Face Switch Transformer's layer does (its output reshaped)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return (x + torch.tanh(self.linear(x))).view(x.shape)


class Scorer(nn.Module):
    """[B, 4] -> [B]: the score comes out of `squeeze(-1)`, a view of the head's output. `both` also returns that
    output itself, the view's base."""

    def __init__(self, both: bool = False):
        super().__init__()
        self.stem, self.head, self.both = nn.Linear(4, 8), nn.Linear(8, 1), both
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        out = self.head(h)
        return (out, out.squeeze(-1)) if self.both else out.squeeze(-1)


def sharded(model: nn.Module) -> nn.Module:
    cfg = load_run_config(None, ["distributed.backend=fsdp"])
    backend = FSDPBackend(cfg, World(rank=0, local_rank=0, size=1, local_size=1), torch.device("cpu"))
    backend.wrap(ModelParts(model, list(model.blocks), []), cfg.training.max_steps)
    return backend.model


def gradients(model: nn.Module, x: torch.Tensor, shift: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradients of a loss that adds to the scores in place, as a user's loss may."""
    scores = model(x)
    scores += shift  # in place, on what the model returned
    (scores * torch.arange(1.0, 1.0 + len(x))).sum().backward()
    return {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for name, p in named(model)}


def named(model: nn.Module):
    """The parameters under the model's own names (FSDP2 keeps them; an activation-checkpointing wrapper would not)."""
    return sorted(model.named_parameters())


def test_a_model_returning_a_view_trains_under_fsdp2_without_its_warning_and_with_the_same_gradients():
    torch.manual_seed(0)
    plain = Scorer()
    model = sharded(copy.deepcopy(plain))
    x, shift = torch.randn(5, 4), torch.randn(5, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = gradients(model, x, shift)
    assert not [w for w in caught if VIEW_WARNING in str(w.message)], [str(w.message) for w in caught]
    shift_grad = shift.grad.clone()
    shift.grad = None
    expected = gradients(plain, x, shift)
    assert ours.keys() == expected.keys() and len(ours) == 8
    for name, grad in ours.items():
        torch.testing.assert_close(grad, expected[name], msg=name)
    torch.testing.assert_close(shift_grad, shift.grad)


def test_the_root_output_is_the_models_own_storage_not_a_copy():
    model = sharded(Scorer())
    heads = []
    model.head.register_forward_hook(lambda module, args, output: heads.append(output))
    scores = model(torch.randn(3, 4))
    assert scores._base is None and scores.requires_grad
    assert scores.untyped_storage().data_ptr() == heads[0].untyped_storage().data_ptr()  # a logits-sized copy: none
    with torch.no_grad():  # evaluation: FSDP2 hooks nothing, and nothing is changed
        assert model(torch.randn(3, 4))._base is heads[1]


def test_a_view_whose_base_is_also_returned_is_left_a_view():
    """Outputs that share values stay as autograd knows them (FSDP2 then warns, rightly)."""
    model = sharded(Scorer(both=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, scores = model(torch.randn(3, 4))
    assert scores._base is out
    assert [w for w in caught if VIEW_WARNING in str(w.message)]
