"""A ZeRO-0 bf16/fp16 file, DeepSpeed's optimizer wrapper in either form, read by parameter name
(checkpoint/zero0_wrapper.py): the fp32 masters, not the module's 16-bit copies; tied names, buffers, moments, the
fp16 loss scale. The files are laid out as DeepSpeed 0.19 saves them (tests/processes/test_zero0_bf16_resume.py
trains real ones)."""

import pytest
import torch

from distsetup.training.checkpoint.named_state import lazy_state
from distsetup.training.checkpoint.streamed_io import materialized

GROUPS = [["wte.weight"], ["ln.weight", "ln.bias"]]  # decayed matrices, then the rest (training.optim)
SCALE = {"dynamic_loss_scale": True, "cur_scale": 1024.0, "cur_iter": 7, "last_overflow_iter": 4}
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


def masters() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"wte.weight": torch.randn(4, 3), "ln.weight": torch.randn(3), "ln.bias": torch.randn(3)}


def moment(name: str, key: str) -> torch.Tensor:
    return masters()[name] * (2.0 if key == "exp_avg" else 3.0)


def write_zero0(folder, flat: bool) -> None:
    """mp_rank_00_model_states.pt of a bf16 run (fp16's loss-scale fields too) with a tied lm_head and a buffer
    inside an activation-checkpointed block."""
    fp32 = masters()
    wte = fp32["wte.weight"].to(torch.bfloat16)
    module = {"wte.weight": wte, "ln.weight": fp32["ln.weight"].bfloat16(), "ln.bias": fp32["ln.bias"].bfloat16()}
    module |= {"lm_head.weight": wte, "blocks.0.mask": torch.ones(2, 2)}
    settings = [{"lr": 1e-3, "weight_decay": 0.1}, {"lr": 1e-3, "weight_decay": 0.0}]
    if flat:
        wrapper = {
            "fp32_groups_flat": [torch.cat([fp32[n].reshape(-1) for n in group]) for group in GROUPS],
            "optimizer_state_dict": {
                "state": {
                    g: {"step": 5, **{k: torch.cat([moment(n, k).reshape(-1) for n in group]) for k in MOMENT_KEYS}}
                    for g, group in enumerate(GROUPS)
                },
                "param_groups": [{**s, "params": [g]} for g, s in enumerate(settings)],
            },
            "clip_grad": 1.0,
        }
    else:
        order = [name for group in GROUPS for name in group]
        wrapper = {
            **SCALE,
            "scale_factor": 2.0,
            "scale_window": 4,
            "fp32_groups": [[fp32[n] for n in group] for group in GROUPS],
            "optimizer_state_dict": {
                "state": {
                    i: {"step": torch.tensor(5.0), **{k: moment(n, k) for k in MOMENT_KEYS}}
                    for i, n in enumerate(order)
                },
                "param_groups": [{**settings[0], "params": [0]}, {**settings[1], "params": [1, 2]}],
            },
        }
    torch.save(
        {
            "module": module,
            "buffer_names": ["blocks.0._checkpoint_wrapped_module.mask"],  # as DeepSpeed names it
            "optimizer": wrapper,
            "lr_scheduler": {"last_epoch": 5},
        },
        folder / "mp_rank_00_model_states.pt",
    )


@pytest.mark.parametrize("flat", [False, True], ids=["per parameter", "flat"])
@pytest.mark.parametrize("groups", [GROUPS, None], ids=["run's groups", "weights alone"])
def test_the_fp32_masters_moments_and_ties_come_back_by_name(tmp_path, flat, groups):
    write_zero0(tmp_path, flat)
    state = materialized(lazy_state(tmp_path, "zero0", groups))
    model, fp32 = state["model"], masters()
    assert all(torch.equal(model[name], tensor) and model[name].dtype == torch.float32 for name, tensor in fp32.items())
    assert torch.equal(model["lm_head.weight"], fp32["wte.weight"])  # the tied name: the same master
    assert torch.equal(model["blocks.0.mask"], torch.ones(2, 2))  # a buffer, not taken for a parameter
    if groups is None:
        assert state["optimizer"] is None
        return
    moments = state["optimizer"]["state"]
    assert all(torch.equal(moments[n][k], moment(n, k)) for n in fp32 for k in MOMENT_KEYS)
    assert all(float(moments[n]["step"]) == 5 for n in fp32)
    assert [g["params"] for g in state["optimizer"]["param_groups"]] == GROUPS
    assert [g["weight_decay"] for g in state["optimizer"]["param_groups"]] == [0.1, 0.0]


def test_an_fp16_wrappers_loss_scale_comes_back_as_gradscaler_state(tmp_path):
    write_zero0(tmp_path, flat=False)
    scaler = lazy_state(tmp_path, "zero0", GROUPS)["scaler"]
    # 2 good steps since the overflow at iteration 4: DeepSpeed grows after 3 more (window 4, +1), torch at 4 - 1
    assert scaler == {
        "scale": 1024.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 4,
        "_growth_tracker": 1,
    }


@pytest.mark.parametrize("flat", [False, True], ids=["per parameter", "flat"])
def test_names_that_do_not_make_up_the_masters_are_refused(tmp_path, flat):
    write_zero0(tmp_path, flat)
    with pytest.raises(ValueError, match="fp32 masters are shaped"):
        lazy_state(tmp_path, "zero0", [["wte.weight"], ["ln.weight"]])
