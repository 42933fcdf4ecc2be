"""The signals that stop a run at a checkpoint, delivered for real to this process: SIGTERM and SIGUSR1 ask for
it; so does a first Ctrl-C while the loop runs (outside it, and the second time, Ctrl-C stops at once)."""

import os
import signal

import pytest

from distsetup.training.preemption import INTERRUPTED, PREEMPTED, Preemption


@pytest.fixture
def handlers():
    """The signal handlers as they were, back after the test (Preemption takes them over, as a rank does)."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1", "SIGINT"])
def test_each_signal_asks_for_a_checkpoint_in_the_loop_and_a_second_ctrl_c_stops_at_once(handlers, capfd, name):
    preemption = Preemption(announce=True)
    with preemption.ctrl_c_checkpoints():
        assert not preemption.requested
        os.kill(os.getpid(), getattr(signal, name))  # Python runs the handler before the next line
        assert preemption.requested
        assert preemption.status == (INTERRUPTED if name == "SIGINT" else PREEMPTED)
        said = capfd.readouterr().err
        assert ("Ctrl-C: checkpointing, then stopping (Ctrl-C again stops at once" in said) == (name == "SIGINT")
        with pytest.raises(KeyboardInterrupt):  # after any of them: the user wants out now
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_outside_the_loop_stops_at_once_and_only_the_announcer_speaks(handlers, capfd):
    """Set-up (tokenizing a corpus, loading a checkpoint) is no place to wait for a step's agreement; a process that
    does not announce (another rank, a DataLoader worker forked from rank 0) only takes note."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job's is ignored)
    preemption = Preemption(announce=False)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # left as it was until the loop
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    assert not preemption.requested
    with preemption.ctrl_c_checkpoints():
        os.kill(os.getpid(), signal.SIGINT)
    assert preemption.requested and capfd.readouterr().err == ""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handed back after the loop
