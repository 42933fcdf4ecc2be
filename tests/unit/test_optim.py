"""training/optim.py: what every backend's optimizer shares."""

import torch

from distsetup.training.optim import count_steps_as_it_does


class OwnAdam(torch.optim.Adam):
    """Stands for DeepSpeed's own optimizers (CPU Adam, FusedAdam): defined outside torch.optim, an int step."""


def loaded(optimizer: torch.optim.Optimizer, step) -> torch.optim.Optimizer:
    """`optimizer` as a load leaves it: each parameter's step as the checkpoint stored it."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            optimizer.state[param]["step"] = step
    return optimizer


def test_torch_counts_a_loaded_step_in_a_tensor_on_the_cpu_or_where_a_fused_kernel_needs_it():
    plain = torch.nn.Parameter(torch.zeros(2))
    elsewhere = [torch.nn.Parameter(torch.zeros(2, device="meta")) for _ in range(2)]  # a device that is not the CPU
    optimizers = [
        loaded(torch.optim.AdamW([plain]), 7),
        loaded(torch.optim.AdamW([elsewhere[0]], fused=True), 7),
        loaded(torch.optim.AdamW([elsewhere[1]], capturable=True), torch.tensor(7.0)),
    ]
    for optimizer in optimizers:
        count_steps_as_it_does(optimizer)
    steps = [next(iter(optimizer.state.values()))["step"] for optimizer in optimizers]
    places = [(step.dtype, step.device.type) for step in steps]
    assert places == [(torch.float32, "cpu"), (torch.float32, "meta"), (torch.float32, "meta")]
    assert float(steps[0]) == 7.0


def test_deepspeeds_own_optimizers_count_a_loaded_step_in_an_int():
    optimizer = loaded(OwnAdam([torch.nn.Parameter(torch.zeros(2))]), torch.tensor(7.0))
    count_steps_as_it_does(optimizer)
    step = next(iter(optimizer.state.values()))["step"]
    assert step == 7 and type(step) is int


def test_sub_groups_sharing_one_loaded_step_tensor_get_one_each():
    """DeepSpeed 0.19's ZeRO-3 universal load gives every sub-group one tensor, which AdamW would advance once per
    sub-group."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))])
    shared = torch.tensor(7.0)
    for param in optimizer.param_groups[0]["params"]:
        optimizer.state[param]["step"] = shared
    count_steps_as_it_does(optimizer)
    first, second = (state["step"] for state in optimizer.state.values())
    first += 1
    assert float(second) == 7.0 and float(shared) == 7.0
