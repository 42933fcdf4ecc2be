"""A training.loss reads the model's own parameters and values through DDP's wrapper (a Crowd-BT scorer's annotator
reliabilities), as under FSDP2 and DeepSpeed; the model's methods stay behind DDP's forward, with an error that says
why."""

import pytest
import torch
import torch.nn as nn
from repo import free_port

from distsetup.training.backends.ddp import ModelValuesThrough


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.score = nn.Linear(4, 1)
        self.annotator_logit = nn.Parameter(torch.zeros(3))
        self.annotators = 3

    def forward(self, x):
        return self.score(x).squeeze(-1)

    def encode(self, x):
        return self.score(x)


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_a_loss_reads_the_models_parameters_through_ddp_not_its_methods():
    """Bug: `model.annotator_logit` in a loss raised "'DistributedDataParallel' object has no attribute" under DDP
    only (FSDP2 and DeepSpeed gave it), told to fix training.loss."""
    model = Scorer()
    ddp = ModelValuesThrough(model)
    assert ddp.annotator_logit is model.annotator_logit and ddp.annotators == 3
    reliability = torch.sigmoid(ddp.annotator_logit)[torch.tensor([0, 2])]
    (ddp(torch.ones(2, 4)) * reliability).sum().backward()
    assert model.annotator_logit.grad is not None and model.annotator_logit.grad[1] == 0
    assert not hasattr(ddp, "encode")  # an AttributeError still, as hasattr() expects
    with pytest.raises(AttributeError, match=r"only the model's forward, model\(\.\.\.\), keeps DDP's gradients"):
        ddp.encode(torch.ones(1, 4))
    with pytest.raises(AttributeError):
        _ = ddp.nothing_of_the_kind


def test_ddp_keeps_looking_for_unused_parameters_beside_experts_and_says_why_a_step_waited():
    """The HF Trainer's ddp_find_unused_parameters: false (set for speed) beside an MoE layer whose experts differ per
    rank would make DDP wait for experts a rank did not run: refused before the process group. Where DDP looks
    already and still waits, an output of the forward is not in the loss (torch's own words): said so, not "set
    find_unused_parameters"."""
    from distsetup.errors import DistsetupError
    from distsetup.formats.runconfig_load import load_run_config
    from distsetup.training.backends.ddp import DDPBackend, unused_parameters
    from distsetup.training.launch_env import World
    from distsetup.training.model.build import Description

    cfg = load_run_config(None, ["training.ddp_find_unused_parameters=false"])
    backend = DDPBackend(cfg, World(rank=0, local_rank=0, size=1, local_size=1), torch.device("cpu"))
    backend.check_model(Description([], 10, ""))  # no experts: DDP need not look
    with pytest.raises(DistsetupError, match="distributed.find_unused_parameters false with SwitchFFN") as refused:
        backend.check_model(Description([], 10, "SwitchFFN (x2)"))
    assert "leave distributed.find_unused_parameters unset" in str(refused.value)
    waited = RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one.")
    assert "set distributed.find_unused_parameters: true" in str(unused_parameters(waited, looking=False))
    assert "an output of the model's forward does not go into the loss" in str(unused_parameters(waited, looking=True))
    assert unused_parameters(RuntimeError("another"), looking=False) is None
