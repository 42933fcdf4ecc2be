"""training.keep_checkpoints: only complete, intact folders older than the newest N are removed; a damaged one, or
one still being written, is never counted and never removed."""

import json

from distsetup.formats.checkpoint_folder import MARKER, Marker, beyond_newest, list_checkpoints, step_dir


def test_keep_checkpoints_removes_only_older_complete_intact_folders(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30, 40, 50):
        folder = step_dir(root, step)
        folder.mkdir(parents=True)
        (folder / "state.pt").write_bytes(b"x" * step)
        if step != 50:  # 50: being written (no marker yet)
            marker = {"backend": "single", "step": step, "world_size": 1, "files": {"state.pt": step}}
            (folder / MARKER).write_text(json.dumps(marker))
    (step_dir(root, 20) / "state.pt").write_bytes(b"x")  # damaged: never counted, never removed
    assert beyond_newest(root, 2) == [step_dir(root, 10)]
    assert beyond_newest(root, 1) == [step_dir(root, 10), step_dir(root, 30)]
    assert beyond_newest(root, 5) == [] and beyond_newest(tmp_path / "none", 1) == []


def test_the_checkpoint_with_the_lowest_validation_loss_is_listed_as_best(tmp_path, run_cli):
    """A marker without val_loss (no evaluation at its step, or an older distsetup's) is never the best; it is
    listed, not kept beyond keep_checkpoints (a quota's setting)."""
    root = tmp_path / "checkpoints"
    for step, val_loss in ((10, 2.0), (20, 1.5), (30, None), (40, 1.7), (50, float("nan"))):
        folder = step_dir(root, step)
        folder.mkdir(parents=True)
        (folder / "state.pt").write_bytes(b"x")
        marker = Marker(backend="single", step=step, world_size=1, val_loss=val_loss, files={"state.pt": 1})
        (folder / MARKER).write_text(marker.to_json())
    assert json.loads((step_dir(root, 50) / MARKER).read_text())["val_loss"] is None  # JSON has no NaN
    assert "val_loss" not in json.loads((step_dir(root, 30) / MARKER).read_text())
    assert beyond_newest(root, 1) == [step_dir(root, step) for step in (10, 20, 30, 40)]
    listed = list_checkpoints(tmp_path)
    assert [(c.step, c.val_loss, c.best, c.resume) for c in listed] == [
        (10, 2.0, False, False),
        (20, 1.5, True, False),
        (30, None, False, False),
        (40, 1.7, False, False),
        (50, None, False, True),
    ]
    table = run_cli("checkpoint", "ls", tmp_path).stdout.splitlines()  # the folder's line, the heading's, the steps'
    assert table[3].split()[-3:] == ["1.5000", "<-", "best"] and table[4].split()[-1] == "-"
    assert table[6].split()[-3:] == ["-", "<-", "resume"]
