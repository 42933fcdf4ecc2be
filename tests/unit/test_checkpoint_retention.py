"""training.keep_checkpoints: only complete, intact folders older than the newest N are removed; a damaged one, or
one still being written, is never counted and never removed."""

import json

from distsetup.formats.checkpoint_folder import MARKER, beyond_newest, step_dir


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
