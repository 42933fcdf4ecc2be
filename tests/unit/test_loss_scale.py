"""The fp16 loss scale carried between DeepSpeed's DynamicLossScaler and torch's GradScaler (checkpoint/loss_scale.py):
after a conversion the target scaler holds the same scale and grows, or backs off, at the same steps as the source
would have. Both scalers are the real ones, driven by real backward passes (an overflow is an infinite gradient)."""

import pytest
import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from repo import free_port

from distsetup.training.backends.deepspeed_comm import leave_out_shared_memory_all_reduce
from distsetup.training.checkpoint import loss_scale

WINDOW = 4
# good (False) and overflowing (True) steps; a conversion happens after each prefix of them
HISTORY = (False,) * 6 + (True,) + (False,) * 5 + (True, True) + (False,) * 3


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    """DeepSpeed's scaler asks deepspeed.comm for its rank when it meets an overflow: a one-process gloo group."""
    import deepspeed.comm
    import deepspeed.comm.comm as deepspeed_comm

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    leave_out_shared_memory_all_reduce()  # as the trainer does: not compiled here either
    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    yield
    torch.distributed.destroy_process_group()
    deepspeed_comm.cdb = None


def deepspeed_scaler(hysteresis: int = 1, window: int = WINDOW) -> DynamicLossScaler:
    return DynamicLossScaler(
        init_scale=2.0**16, scale_window=window, min_scale=1, delayed_shift=hysteresis, consecutive_hysteresis=False
    )


class TorchRun:
    """A GradScaler on the CPU scaling the backward of one parameter, stepped by SGD at lr 0."""

    def __init__(self, state: dict | None = None):
        self.param = torch.nn.Parameter(torch.ones(3))
        self.optimizer = torch.optim.SGD([self.param], lr=0.0)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=WINDOW)
        if state is not None:
            self.scaler.load_state_dict(state)

    def steps(self, overflows) -> list[float]:
        """The scale after each step; a step overflows where its flag is True."""
        scales = []
        for overflow in overflows:
            loss = self.param.sum() * (float("inf") if overflow else 1.0)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad()
            scales.append(self.scaler.get_scale())
        return scales


def deepspeed_steps(scaler: DynamicLossScaler, overflows) -> list[float]:
    scales = []
    for overflow in overflows:
        scaler.update_scale(overflow)
        scales.append(float(scaler.cur_scale))
    return scales


def until_overflow(overflows) -> tuple:
    """The steps up to and including the first overflow: after one, torch grows a step before DeepSpeed."""
    return overflows[: overflows.index(True) + 1] if True in overflows else overflows


def just_after_overflow_or_start(history) -> bool:
    return not history or history[-1]


@pytest.mark.parametrize("cut", range(len(HISTORY)))
def test_a_scale_carried_from_deepspeed_to_torch_changes_when_deepspeed_would_change_it(cut):
    source = deepspeed_scaler()
    deepspeed_steps(source, HISTORY[:cut])
    state = loss_scale.from_deepspeed(source)
    target = TorchRun(state)
    assert target.scaler.get_scale() == source.cur_scale

    if just_after_overflow_or_start(HISTORY[:cut]):
        # DeepSpeed grows at the (window + 1)-th good step after an overflow (or the start), torch at the window-th
        good, scale = (False,) * (WINDOW + 1), state["scale"]
        assert deepspeed_steps(source, good) == [scale] * WINDOW + [2 * scale]
        assert target.steps(good) == [scale] * (WINDOW - 1) + [2 * scale] * 2
    else:
        rest = until_overflow(HISTORY[cut:] + (False,) * (WINDOW + 1))
        assert target.steps(rest) == deepspeed_steps(source, rest)


@pytest.mark.parametrize("cut", range(len(HISTORY)))
def test_a_scale_carried_from_torch_to_deepspeed_changes_when_torch_would_change_it(cut):
    source = TorchRun()
    source.steps(HISTORY[:cut])
    state = source.scaler.state_dict()
    target = loss_scale.to_deepspeed(state)
    assert target.cur_scale == state["scale"] and target.scale_window == WINDOW and target.cur_hysteresis == 1

    rest = until_overflow(HISTORY[cut:] + (False,) * (WINDOW + 1))
    assert deepspeed_steps(target, rest) == source.steps(rest)


@pytest.mark.parametrize("cut", range(len(HISTORY)))
def test_a_deepspeed_run_resuming_a_deepspeed_checkpoint_keeps_its_settings_at_the_saved_scale(cut):
    saved = deepspeed_scaler(hysteresis=2)
    deepspeed_steps(saved, HISTORY[:cut])
    twin = deepspeed_scaler(hysteresis=2)
    deepspeed_steps(twin, HISTORY[:cut])

    own = deepspeed_scaler(hysteresis=2)  # the same settings as the run that saved: it goes on as that run would
    loss_scale.restore(own, saved)
    rest = HISTORY[cut:] + (False,) * (WINDOW + 1)
    assert deepspeed_steps(own, rest) == deepspeed_steps(twin, rest)


def test_a_run_with_other_settings_takes_the_scale_and_no_more_than_its_own_hysteresis_and_window():
    saved = deepspeed_scaler(hysteresis=3, window=100)
    deepspeed_steps(saved, (False, True, False))  # scale kept (hysteresis 3 -> 2), 100 good steps to growth
    own = deepspeed_scaler(hysteresis=1, window=2)
    own.cur_scale = 8.0

    loss_scale.restore(own, saved)
    assert (own.cur_scale, own.cur_hysteresis, own.scale_window) == (2.0**16, 1, 2)
    assert deepspeed_steps(own, (False,) * 3) == [2.0**16, 2.0**16, 2.0**17]  # its own window, at the latest
    assert deepspeed_steps(own, (True,)) == [2.0**16]  # its own hysteresis: the first overflow halves


@pytest.mark.parametrize("static_side", ["saved", "own"])
def test_a_static_scale_on_either_side_is_neither_read_nor_changed(static_side):
    dynamic = deepspeed_scaler()
    deepspeed_steps(dynamic, (False, True))
    static = LossScaler(scale=128)
    saved, own = (static, dynamic) if static_side == "saved" else (dynamic, static)
    before = dict(vars(own))

    loss_scale.restore(own, saved)
    assert vars(own) == before
    assert loss_scale.from_deepspeed(static) is None


def test_a_saved_scale_below_the_runs_minimum_comes_up_to_it():
    saved = deepspeed_scaler()
    saved.cur_scale = 0.25  # a run whose fp16.min_loss_scale allowed it
    own = deepspeed_scaler()  # min_loss_scale 1: DeepSpeed would raise the next halving to it
    loss_scale.restore(own, saved)
    assert own.cur_scale == own.min_scale == 1


@pytest.mark.parametrize("name", ["single", "ddp"])
def test_a_step_the_loss_scale_skips_leaves_the_schedule_where_it_is(name):
    """As DeepSpeed's engine and Accelerate's scheduler: the torch backends' fp16 runs advanced the learning rate
    through warmup and decay on steps that updated nothing (an overflow), so one run config followed another
    schedule under DDP than under DeepSpeed. A real GradScaler sees a real infinite gradient."""
    from distsetup.formats.runconfig_load import load_run_config
    from distsetup.training.backends import make_backend
    from distsetup.training.launch_env import World
    from distsetup.training.model.build import ModelParts

    settings = ["training.precision=fp16", "training.warmup_steps=4", "training.lr=0.01"]
    cfg = load_run_config(None, [f"distributed.backend={name}", *settings])
    backend = make_backend(name, cfg, World(rank=0, local_rank=0, size=1, local_size=1), torch.device("cpu"))
    backend.wrap(ModelParts(module=torch.nn.Linear(3, 1), blocks=[], conditional=[]), steps=10)
    lrs = []
    for overflow in (True, True, False, True, False):
        lrs.append(backend.current_lr())
        loss = backend.model(torch.ones(2, 3)).sum() * (float("inf") if overflow else 1.0)
        backend.scaler.scale(loss).backward()
        backend.step()
    assert lrs == pytest.approx([0.002, 0.002, 0.002, 0.004, 0.004])  # warmup moves on the good steps only
    assert backend.current_lr() == pytest.approx(0.006)
