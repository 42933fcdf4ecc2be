"""The signals that stop a run at a checkpoint, delivered for real to this process: SIGTERM, SIGUSR1 and a first
Ctrl-C ask for it; a second Ctrl-C stops at once."""

import os
import signal

import pytest

from distsetup.training.preemption import Preemption


@pytest.fixture
def handlers():
    """The signal handlers as they were, back after the test (Preemption takes them over, as a rank does)."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1", "SIGINT"])
def test_each_signal_asks_for_a_checkpoint_and_a_second_ctrl_c_stops_at_once(handlers, capfd, name):
    preemption = Preemption()
    assert not preemption.requested
    os.kill(os.getpid(), getattr(signal, name))  # Python runs the handler before the next line
    assert preemption.requested
    said = capfd.readouterr().err
    assert ("Ctrl-C: checkpointing, then stopping (Ctrl-C again stops at once" in said) == (name == "SIGINT")
    with pytest.raises(KeyboardInterrupt):  # after any of them: the user wants out now
        os.kill(os.getpid(), signal.SIGINT)
