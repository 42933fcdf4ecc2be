"""Checkpoints whose COMPLETE marker another distsetup wrote: without a loss, with only part of a data position,
with keys this one does not know. A run resumed from one at its last step trains nothing, says in one line that the
data starts at its first sample, and writes a summary.json that is valid JSON (final_loss null, never NaN);
`distsetup checkpoint convert` keeps the keys it does not know."""

import json
import shutil

import pytest
from train_runs import STEPS, copied_run, train

from distsetup.formats.checkpoint_folder import MARKER, step_dir

NEWER = {"written_by_version": "9.9", "data_files": {"train": "a.bin"}}  # what a newer distsetup might add


def strict_json(text: str):
    """JSON as any reader but Python's reads it: NaN and Infinity refused."""

    def refused(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refused)


@pytest.fixture(scope="module")
def older_checkpoint(tmp_path_factory):
    """A copy of the session's finished one-process run, its last checkpoint's marker made as another distsetup
    would write it; its config (the shared run's, writing into the copy)."""
    folder = tmp_path_factory.mktemp("older")
    config = copied_run("single", folder)
    marker = step_dir(folder / "out" / "checkpoints", STEPS) / MARKER
    raw = json.loads(marker.read_text())
    del raw["loss"]
    raw["sampler"] = {"epoch": 0}  # a data position without the samples read
    marker.write_text(json.dumps({**raw, **NEWER}))
    return config


def test_a_run_resumed_at_its_last_step_from_an_older_marker_writes_valid_json(tmp_path, older_checkpoint):
    shutil.copytree(older_checkpoint.parent / "out", tmp_path / "out")
    (tmp_path / "out" / "summary.json").unlink()  # the checkpoints alone (a finished run's summary would stay)
    result = train(older_checkpoint, 1, f"training.output_dir={tmp_path / 'out'}")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"(step {STEPS})" in result.stdout and "holds no data position" in result.stdout, result.stdout[-2000:]
    summary = strict_json((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["final_loss"] is None  # no step ran, and the marker held no loss


def test_checkpoint_convert_keeps_the_marker_keys_it_does_not_know(run_cli, tmp_path, older_checkpoint):
    result = run_cli("checkpoint", "convert", older_checkpoint.parent / "out", "--to", "fsdp", "-o", tmp_path / "new")
    assert result.exit_code == 0, result.output
    converted = json.loads((step_dir(tmp_path / "new" / "checkpoints", STEPS) / MARKER).read_text())
    assert {key: converted.get(key) for key in NEWER} == NEWER
    assert converted["backend"] == "fsdp" and converted["sampler"] == {"epoch": 0}
