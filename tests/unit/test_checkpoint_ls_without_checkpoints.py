"""`distsetup checkpoint ls` where there is nothing of distsetup's to list: a folder that is not there is one line
and exit 1, a folder without checkpoints says so, another program's step folders are named for it."""

import json


def test_ls_of_a_folder_that_is_not_there_is_one_line(run_cli, tmp_path):
    result = run_cli("checkpoint", "ls", tmp_path / "nowhere")
    assert result.exit_code == 1 and "no such folder" in result.stderr
    assert run_cli("checkpoint", "ls", tmp_path).stdout.strip() == f"{tmp_path}: no checkpoints."


def test_ls_names_an_accelerate_save_state_folder_as_accelerates(run_cli, tmp_path):
    """A user's Accelerate program's step folders were listed as distsetup checkpoints stopped mid-save."""
    for step, files in ((10, ("model.safetensors", "optimizer.bin", "random_states_0.pkl")), (20, ("model.pt",))):
        folder = tmp_path / f"step_{step:04d}"
        folder.mkdir()
        for name in files:
            (folder / name).write_bytes(b"0")
    listed = run_cli("checkpoint", "ls", tmp_path, "--json")
    problems = [row["problem"] for row in json.loads(listed.stdout)]
    assert problems == [
        "an Accelerate save_state folder, not distsetup's trainer's (Accelerator.load_state reads it)",
        "no COMPLETE marker (being written, or stopped mid-save)",
    ]
