"""Rank 0's progress (training/progress.py): a bar in a terminal; in a job's log, one plain line per logged step and
no carriage returns."""

import io

from distsetup.training.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_per_logged_step_and_no_bar(capsys):
    log = io.StringIO()
    progress = Progress(total=100, initial=40, shown=True, terminal=log)
    for _ in (41, 42):
        progress.step_done()
    progress.logged(42, 0.123456, 3e-4, 51234.5, "tokens")
    progress.logged(43, 0.1, 2e-4, 6.0, "samples", mfu=0.4567)
    progress.logged(44, 0.1, 2e-4, 6.0, "samples", loss_scale=32768.0)  # fp16's
    progress.say("step 43: validation loss 0.2000")
    progress.close()
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        "step 42/100: loss 0.1235, lr 3.00e-04, 5.12e+04 tokens/s",  # MFU not known (a CPU without a peak)
        "step 43/100: loss 0.1000, lr 2.00e-04, 6 samples/s, MFU 45.7%",
        "step 44/100: loss 0.1000, lr 2.00e-04, 6 samples/s, loss scale 32768",
        "step 43: validation loss 0.2000",
    ]
    assert log.getvalue() == ""  # no bar drawn where a terminal would be


def test_a_terminal_gets_the_bar_with_the_figures_on_it(capsys):
    terminal = Terminal()
    progress = Progress(total=100, initial=40, shown=True, terminal=terminal)
    progress.step_done()
    progress.logged(41, 0.5, 1e-3, 10.0, "samples", loss_scale=512.0)
    progress.close()
    drawn = terminal.getvalue()
    assert "\r" in drawn and "41/100" in drawn and "loss=0.5000" in drawn and "lr=1.00e-03" in drawn
    assert "loss_scale=512" in drawn
    assert "step 41/100" not in capsys.readouterr().out  # the figures are on the bar, not on lines of their own


def test_other_ranks_show_nothing(capsys):
    for terminal in (io.StringIO(), Terminal()):
        progress = Progress(total=10, initial=0, shown=False, terminal=terminal)
        progress.step_done()
        progress.logged(1, 1.0, 1e-3, 1.0, "tokens")
        progress.say("step 1: validation loss 1.0")
        progress.close()
        assert terminal.getvalue() == "" and capsys.readouterr().out == ""
