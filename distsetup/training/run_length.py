"""How many optimizer steps a run takes: training.max_steps, or training.epochs over the training set; the
environment's DISTSETUP_MAX_STEPS caps either (a smoke run's length: the docs' tests run their commands so)."""

import os

from distsetup.errors import DistsetupError

STEP_CAP = "DISTSETUP_MAX_STEPS"


def step_cap() -> int | None:
    """DISTSETUP_MAX_STEPS, or None where it is unset or empty."""
    value = os.environ.get(STEP_CAP)
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise DistsetupError(f"{STEP_CAP} is {value!r}.", "set it to a whole number of steps, 1 or more, or unset it.")
    return int(value)


def run_steps(
    max_steps: int, epochs: int | None, per_epoch: int, cap: int | None, resumed: tuple[int, int] | None = None
) -> tuple[int, list[str]]:
    """The run's steps (training.max_steps, or `epochs` x the `per_epoch` steps of one pass over the training set,
    at most `cap`) and a line for the user on each of those two choices that applied. `resumed`: (the checkpoint's
    step, the steps from its data position to the end of the epochs): where its steps were of another global batch
    (or the data has another size), the epochs end where its position says."""
    steps, said = max_steps, []
    if epochs is not None:
        steps = epochs * per_epoch
        said.append(f"{epochs} epoch{'s' if epochs != 1 else ''} of {per_epoch} steps: {steps} steps")
        if resumed is not None and sum(resumed) != steps:
            steps = sum(resumed)
            said[-1] = (
                f"{epochs} epochs: {steps} steps (the checkpoint's {resumed[0]}, then {resumed[1]} from its data "
                f"position, {per_epoch} an epoch)"
            )
    if cap is not None and steps > cap:
        steps = cap
        said.append(f"{STEP_CAP} caps the run at {steps} steps (its learning rate follows the whole run's schedule)")
    return steps, said
