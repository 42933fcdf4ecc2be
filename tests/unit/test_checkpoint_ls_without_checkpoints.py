"""`distsetup checkpoint ls` where there is nothing to list: a folder that is not there is one line and exit 1,
a folder without checkpoints says so."""


def test_ls_of_a_folder_that_is_not_there_is_one_line(run_cli, tmp_path):
    result = run_cli("checkpoint", "ls", tmp_path / "nowhere")
    assert result.exit_code == 1 and "no such folder" in result.stderr
    assert run_cli("checkpoint", "ls", tmp_path).stdout.strip() == f"{tmp_path}: no checkpoints."
