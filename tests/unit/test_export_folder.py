"""What `checkpoint export` and `convert` read and write: the newest intact checkpoint or the step named, the damaged
ones passed over said; a new folder whole or not at all (a SIGTERM mid-way included), readable as any new folder."""

import errno
import json
import os
import signal
import stat
import time
from pathlib import Path

import pytest

from distsetup.errors import DistsetupError
from distsetup.formats.checkpoint_folder import MARKER, step_dir
from distsetup.training.checkpoint.export import newest_checkpoint, read_errors, write_new_folder


def test_a_sigterm_mid_write_leaves_nothing_and_exits_143(tmp_path):
    def write(folder):
        (folder / "part.bin").write_bytes(b"x" * 1000)
        os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's kill or a timeout sends it
        time.sleep(5)  # never reached: the handler raises at once

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as ended:
        write_new_folder(tmp_path / "out", write)
    assert ended.value.code == 143
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its hidden staging folder
    assert signal.getsignal(signal.SIGTERM) is before  # the handler it set is gone again


def test_the_folder_has_a_new_folders_permissions(tmp_path):
    mask = os.umask(0o022)
    try:
        write_new_folder(tmp_path / "out", lambda folder: (folder / "a").write_text("a"))
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755  # mkdtemp's are 0700: teammates could not read
    assert (tmp_path / "out" / "a").read_text() == "a"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o2775)  # a group's folder: what is made in it stays the group's
    write_new_folder(shared / "out", lambda folder: None)
    assert stat.S_IMODE((shared / "out").stat().st_mode) & stat.S_ISGID


@pytest.mark.parametrize("where", ["unwritable", "full disk"])
def test_an_output_that_cannot_be_written_is_said_of_o_not_of_the_checkpoint(tmp_path, where):
    """export and convert said "cannot export checkpoint .../step_200: ... move .../step_200 aside", for an -o in a
    folder nobody can write to or a disk out of room: the hint would set a good checkpoint aside."""
    if where == "unwritable":
        out, write = Path("/proc/no-such-output"), lambda folder: None
    else:
        out = tmp_path / "out"

        def write(folder):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a write() that finds no room says it

    with pytest.raises(DistsetupError, match=rf"cannot write -o {out}: ") as info:
        with read_errors(tmp_path / "checkpoints" / "step_200", "export"):
            write_new_folder(out, write)
    assert "aside" not in info.value.hint and list(tmp_path.iterdir()) == []


def checkpoints_of_steps(root, steps):
    for step in steps:
        folder = step_dir(root, step)
        folder.mkdir(parents=True)
        (folder / "state.pt").write_bytes(b"x" * step)
        marker = {"backend": "single", "step": step, "world_size": 1, "files": {"state.pt": step}}
        (folder / MARKER).write_text(json.dumps(marker))


def test_export_names_the_newest_damaged_checkpoint_it_passes_over_or_takes_the_step_named(tmp_path, capsys):
    """As the trainer does, export and convert say in a line which newer checkpoint they passed over; a step_N
    folder named is that checkpoint (DeepSpeed's and the HF Trainer's users name one), refused if it is damaged."""
    root = tmp_path / "checkpoints"
    checkpoints_of_steps(root, (10, 20, 30))
    (step_dir(root, 30) / "state.pt").write_bytes(b"x")  # truncated
    assert newest_checkpoint(root) == step_dir(root, 20)
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith(f"passed over damaged checkpoint {step_dir(root, 30)}: state.pt")
    assert newest_checkpoint(step_dir(root, 10)) == step_dir(root, 10)
    with pytest.raises(DistsetupError, match="is damaged"):
        newest_checkpoint(step_dir(root, 30))


def test_ls_of_one_step_folder_lists_that_step(run_cli, tmp_path):
    """`checkpoint ls RUN/checkpoints/step_N` lists that checkpoint (it said "no checkpoints"), without the
    resume arrow: a resume reads the run's folder."""
    root = tmp_path / "checkpoints"
    checkpoints_of_steps(root, (10, 20))
    result = run_cli("checkpoint", "ls", step_dir(root, 10), "--json")
    listed = json.loads(result.stdout)
    assert [(c["step"], c["complete"], c["resume"]) for c in listed] == [(10, True, False)]
