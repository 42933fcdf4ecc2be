"""peak_activation_bytes in summary.json (saved for backward, one micro-batch, rank 0) against the planner."""

import json

import pytest
from train_runs import MICRO, MODEL, SHARED, feature_run

# run -> (precision, activation checkpointing); the FSDP run also checks that gathered weights are left out
RUNS = {
    "acc_single": ("fp32", False),
    "acc_ddp_ckpt": ("fp32", True),
    "acc_fsdp_ckpt_full_sd": ("fp32", True),
    "acc_zero3_offload": ("fp32", False),
    "bf16_fsdp": ("bf16", False),
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_measured_activation_bytes_match_the_planner(name):
    from distsetup.cli.plan_model import count_on_meta
    from distsetup.formats.runconfig_load import load_run_config
    from distsetup.planning.estimates import Workload, activation_bytes

    precision, checkpointing = RUNS[name]
    measured = json.loads((feature_run(name) / "summary.json").read_text())["peak_activation_bytes"]
    shape = count_on_meta(load_run_config(SHARED / name / "config.yaml"))
    predicted = activation_bytes(shape, Workload(precision, MODEL["block_size"]), MICRO, checkpointing, peak=False)
    assert measured == pytest.approx(predicted, rel=0.25), f"{name}: measured {measured}, planner {predicted:.0f}"
