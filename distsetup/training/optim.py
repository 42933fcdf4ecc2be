"""AdamW parameter groups, optimizer state dicts by name or by number, and the warmup + cosine learning-rate
schedule."""

import math

import torch
import torch.nn as nn

from distsetup.training.memory import full_shape


def decays(shape) -> bool:
    """Decay matrices only (nanoGPT): biases and norm weights keep their scale."""
    return len(shape) >= 2


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The decayed parameters, then the others: every backend's optimizer, so checkpoints number them alike."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if decays(full_shape(p))], "weight_decay": weight_decay},
        {"params": [p for p in params if not decays(full_shape(p))], "weight_decay": 0.0},
    ]


def names_by_group(model: nn.Module, groups: list[dict]) -> list[list[str]]:
    """The names of the parameters in each of optimizer param `groups`, in its order, without what wrappers add
    (activation checkpointing): how checkpoints of every backend name the same parameter."""
    from distsetup.training.model.blocks import plain_name

    name_of = {id(p): plain_name(name) for name, p in model.named_parameters()}
    return [[name_of[id(p)] for p in group["params"]] for group in groups]


def adamw(model: nn.Module, lr: float, betas, weight_decay: float, device: torch.device) -> torch.optim.Optimizer:
    # The fused kernel, as the HF Trainer's default adamw_torch_fused: on a GPU one launch per step for all
    # parameters (a 1B model's per-tensor loop would launch thousands of small kernels), on the CPU 6x faster than
    # the per-tensor loop (a 4 x 256 Llama: 11 ms against 68).
    fused = True if device.type in ("cuda", "cpu") else None
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=tuple(betas), fused=fused)


def count_steps_as_it_does(optimizer: torch.optim.Optimizer) -> None:
    """Each loaded Adam step of `optimizer` as the optimizer counts it: torch's in a float32 tensor (on the CPU, or on
    the parameter's device where its group is fused or capturable, as torch's own load_state_dict places it),
    DeepSpeed's own (CPU Adam, FusedAdam, Lamb, Lion) in an int their kernels take. A load keeps the step as the
    checkpoint stored it, and another optimizer (offloaded or not, another backend's) stores it the other way."""
    in_tensor = type(optimizer).__module__.startswith("torch.optim")
    on_device = {id(p) for g in optimizer.param_groups if g.get("fused") or g.get("capturable") for p in g["params"]}
    for param, state in optimizer.state.items():  # each its own step (ZeRO-3's universal load shares one tensor)
        if "step" in state:
            step, device = float(state["step"]), param.device if id(param) in on_device else "cpu"
            state["step"] = torch.tensor(step, dtype=torch.float32, device=device) if in_tensor else int(step)


def numbered(named: dict) -> dict:
    """A named optimizer state dict as torch's own optimizer numbers it: its parameters in group order."""
    number = {name: i for i, name in enumerate(name for group in named["param_groups"] for name in group["params"])}
    groups = [{**group, "params": [number[name] for name in group["params"]]} for group in named["param_groups"]]
    return {"state": {number[name]: moments for name, moments in named["state"].items()}, "param_groups": groups}


def named(numbered: dict, order: list[str]) -> dict:
    """A torch optimizer's state dict with its numbered parameters named after `order`."""
    groups = [{**group, "params": [order[i] for i in group["params"]]} for group in numbered["param_groups"]]
    return {"state": {order[i]: moments for i, moments in numbered["state"].items()}, "param_groups": groups}


def lr_lambda(warmup_steps: int, max_steps: int, min_lr_ratio: float):
    """Multiplier of the peak lr at optimizer step s: linear warmup, then cosine decay to min_lr_ratio."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def follow_this_runs_schedule(scheduler) -> tuple[float, float] | None:
    """After a checkpoint's load: each group's lr made what this run's schedule gives at the scheduler's step. A run
    resumed with another length (max_steps, epochs) has another schedule, and the lr the checkpoint's run set for the
    next step was its own schedule's. (The checkpoint's lr, this run's) of the first group; None where the scheduler
    is not distsetup's (a DeepSpeed file's own)."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return None
    groups = scheduler.optimizer.param_groups
    stored = groups[0]["lr"]
    step, factors = scheduler.last_epoch, zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)
    lrs = [base * factor(step) for factor, base in factors]
    for group, lr in zip(groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)  # what get_last_lr() says, as step() would have set it
    return float(stored), float(lrs[0])


def lambda_scheduler(optimizer, training, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up, then cosine decay over the run's `steps` (training.max_steps, or its epochs' steps)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(training.warmup_steps, steps, training.min_lr_ratio))
