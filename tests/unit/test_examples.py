"""examples/: each a folder with a run config, the user's code (or model files) and a README whose commands use
them. Here each validates and its README runs its config. The runs that prove each example trains on 2 processes
are shared with the tests of what they show, in tests/processes/: test_own_model.py (pairwise_scorer),
test_moe_runs.py (switch_moe with a routing that differs per rank, hf_moe), and test_switch_example_trains.py
(the Switch example as shipped, its router learning)."""

import re

import pytest
from repo import REPO

EXAMPLES = REPO / "examples"
FOLDERS = sorted(path.name for path in EXAMPLES.iterdir() if path.is_dir())


def test_the_three_examples_are_there():
    assert FOLDERS == ["hf_moe", "pairwise_scorer", "switch_moe"]


@pytest.mark.parametrize("name", FOLDERS)
def test_an_example_validates_and_its_readme_runs_its_config(run_cli, name):
    folder = EXAMPLES / name
    result = run_cli("validate", folder / "config.yaml")
    assert result.exit_code == 0, result.output
    readme = (folder / "README.md").read_text()
    commands = "\n".join(re.findall(r"```bash\n(.*?)```", readme, re.S))
    assert f"--config examples/{name}/config.yaml" in commands and "bash scripts/" in commands
