"""A DeepSpeed file's optimizer and scheduler params, checked against the class DeepSpeed builds of them: every key
and type those classes stop on at start (a typo, a number written as text, one beta) and a negative rate, which
FusedAdam trains with. `validate` said "no problems" of each."""

import inspect
import json

import pytest

from distsetup.formats.deepspeed_params import OPTIMIZERS, SCHEDULERS
from distsetup.formats.validate import validate_file

BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
}


def problems(tmp_path, config: dict, hf: bool = False) -> dict:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return {p.path: p for p in validate_file(path, "deepspeed", hf=hf).problems}


@pytest.mark.parametrize(
    "section, change, path, words",
    [
        ("optimizer", {"lr": "3e-4"}, "optimizer.params.lr", "write 0.0003 unquoted"),
        ("optimizer", {"weight_decay": "0.01"}, "optimizer.params.weight_decay", "not the number it spells"),
        ("optimizer", {"lrr": 0.1}, "optimizer.params.lrr", "DeepSpeedCPUAdam"),
        ("optimizer", {"betas": [0.9]}, "optimizer.params.betas", "two numbers"),
        ("optimizer", {"lr": -1}, "optimizer.params.lr", "out of range"),
        ("optimizer", {"max_grad_norm": 1.0}, "optimizer.params.max_grad_norm", "gradient_clipping"),
        ("scheduler", {"warmup_num_steps": "10"}, "scheduler.params.warmup_num_steps", "without quotes"),
        ("scheduler", {"warmup_num_stepz": 10}, "scheduler.params.warmup_num_stepz", "warmup_num_steps"),
        ("scheduler", {"warmup_num_steps": 0}, "scheduler.params.warmup_num_steps", "at least 1"),
    ],
)
def test_what_deepspeeds_optimizer_or_scheduler_would_stop_on_is_a_problem(tmp_path, section, change, path, words):
    config = json.loads(json.dumps(BASE))
    if section == "scheduler":
        config["scheduler"] = {"type": "WarmupLR", "params": change}
    else:
        config["optimizer"]["params"].update(change)
    found = problems(tmp_path, config)
    assert list(found) == [path] and words in found[path].message + found[path].fix, found


def test_the_params_are_checked_against_the_class_the_file_makes_deepspeed_build(tmp_path):
    """set_grad_none is FusedAdam's (on the device), not DeepSpeedCPUAdam's (offloaded); torch_adam builds torch's."""
    on_device = {**BASE, "zero_optimization": {"stage": 2}}
    with_set_grad_none = {**BASE["optimizer"], "params": {**BASE["optimizer"]["params"], "set_grad_none": True}}
    assert problems(tmp_path, {**on_device, "optimizer": with_set_grad_none}) == {}
    assert list(problems(tmp_path, {**BASE, "optimizer": with_set_grad_none})) == ["optimizer.params.set_grad_none"]
    torch_adam = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True, "foreach": False}}
    assert problems(tmp_path, {**BASE, "optimizer": torch_adam}) == {}


def test_what_deepspeed_takes_beyond_one_number_passes_and_odd_values_are_no_crash(tmp_path):
    """A rate per parameter group, WarmupLR's max left to each group's lr, torch's Adam (adam_w_mode false) with its
    own decoupled_weight_decay, torch's None for foreach: DeepSpeed takes each (the review found them refused). A
    scheduler type that is no name and a key that is no string are problems, not tracebacks."""
    schedule = {"type": "WarmupLR", "params": {"warmup_min_lr": [0, 0], "warmup_max_lr": None}}
    assert problems(tmp_path, {**BASE, "scheduler": schedule}) == {}
    torch_adam = {"lr": 1e-4, "torch_adam": True, "adam_w_mode": False, "decoupled_weight_decay": False}
    assert problems(tmp_path, {**BASE, "optimizer": {"type": "Adam", "params": {**torch_adam, "foreach": None}}}) == {}
    assert list(problems(tmp_path, {**BASE, "scheduler": {"type": ["WarmupLR"], "params": {}}})) == ["scheduler.type"]
    (tmp_path / "ds.yaml").write_text("train_micro_batch_size_per_gpu: 1\noptimizer: {type: AdamW, params: {1: 2}}\n")
    found = [p.path for p in validate_file(tmp_path / "ds.yaml", "deepspeed").problems]
    assert found == ["optimizer.params.[1]"], found
    on_device = {**BASE, "zero_optimization": {"stage": 2}}
    amsgrad = {"type": "AdamW", "params": {"lr": 1e-4, "amsgrad": True}}  # FusedAdam stops on it; CPU Adam takes it
    assert list(problems(tmp_path, {**on_device, "optimizer": amsgrad})) == ["optimizer.params.amsgrad"]
    assert problems(tmp_path, {**BASE, "optimizer": amsgrad}) == {}


def test_an_offload_device_accelerate_decides_takes_what_either_class_takes(tmp_path):
    """Under the HF Trainer, "auto" is accelerate launch --offload_optimizer_device's: DeepSpeedCPULion's
    fp32_optimizer_states passes there (it was checked against FusedLion, as if on the device), not on the device."""
    lion = {"type": "Lion", "params": {"lr": 1e-4, "fp32_optimizer_states": True}}
    zero = {"stage": 2, "offload_optimizer": {"device": "auto"}}
    config = {**BASE, "train_micro_batch_size_per_gpu": "auto", "zero_optimization": zero, "optimizer": lion}
    assert problems(tmp_path, config, hf=True) == {}
    on_device = {**config, "zero_optimization": {"stage": 2}}
    assert list(problems(tmp_path, on_device, hf=True)) == ["optimizer.params.fp32_optimizer_states"]


def test_the_hf_trainers_auto_and_a_needed_key_left_out(tmp_path):
    config = {**BASE, "train_micro_batch_size_per_gpu": "auto"}
    config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
    config["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto"}}
    found = problems(tmp_path, config, hf=True)
    assert (
        list(found) == ["scheduler.params.total_num_steps"]
        and "is missing" in found["scheduler.params.total_num_steps"].message
    )
    config["scheduler"]["params"]["total_num_steps"] = "auto"
    assert problems(tmp_path, config, hf=True) == {}


def _constructor_keys(cls) -> set[str]:
    return set(list(inspect.signature(cls.__init__).parameters)[2:])  # after self and the parameters/optimizer


def test_the_tables_are_the_constructors_deepspeed_and_torch_have():
    """Each class's keys as installed, with what DeepSpeed takes out of an Adam's params first (adam_w_mode,
    torch_adam, fp32_optimizer_states), less what it passes itself (adamw_mode) or refuses (max_grad_norm)."""
    import torch
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.ops.lamb import FusedLamb
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
    from deepspeed.runtime import lr_schedules

    classes = {
        "FusedAdam": FusedAdam,
        "DeepSpeedCPUAdam": DeepSpeedCPUAdam,
        "torch.optim.AdamW": torch.optim.AdamW,
        "torch.optim.Adam": torch.optim.Adam,
        "torch.optim.Adagrad": torch.optim.Adagrad,
        "DeepSpeedCPUAdagrad": DeepSpeedCPUAdagrad,
        "FusedLion": FusedLion,
        "DeepSpeedCPULion": DeepSpeedCPULion,
        "FusedLamb": FusedLamb,
    }
    popped = {"adam_w_mode", "torch_adam", "fp32_optimizer_states"}
    for name, places in OPTIMIZERS.items():
        for built, keys in places.values():
            expected = _constructor_keys(classes[built]) - {"adamw_mode", "max_grad_norm"}
            assert set(keys) == (expected | popped if name in ("adam", "adamw") else expected), built
    for name, (keys, needed) in SCHEDULERS.items():
        signature = list(inspect.signature(getattr(lr_schedules, name).__init__).parameters.values())[2:]
        assert set(keys) == {p.name for p in signature}, name
        assert set(needed) == {p.name for p in signature if p.default is inspect.Parameter.empty}, name
