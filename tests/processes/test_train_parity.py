"""Loss parity: every 2-process backend follows the single-process loss curve (same seed, fp32, global batch)."""

import pytest
from train_runs import RUNS, STEPS, losses, shared_run

RTOL = 1e-4
PARALLEL = [name for name in RUNS if name != "single"]


def test_single_process_loss_falls():
    curve = losses(shared_run("single"))
    assert len(curve) == STEPS
    assert curve[-1] < curve[0] - 0.1, curve


@pytest.mark.parametrize("name", PARALLEL)
def test_loss_curve_matches_single_process(name):
    reference, curve = losses(shared_run("single")), losses(shared_run(name))
    assert len(curve) == len(reference) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(curve, reference, strict=True))
    assert worst <= RTOL, f"{name}: largest relative loss difference {worst:.2e} over {STEPS} steps"
