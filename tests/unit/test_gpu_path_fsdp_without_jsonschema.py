"""An FSDP run reads its FSDP file without importing jsonschema (a quarter of a command's time): read_json's objects,
which remember keys given twice, are JSON objects to the schema's fast check as they are to jsonschema."""

import subprocess
import sys

from click.testing import CliRunner
from repo import REPO
from train_runs import environment, losses, write_config

from distsetup.cli.main import cli
from distsetup.formats.fast_schema import conforms
from distsetup.formats.problems import load_schema
from distsetup.formats.reading import read_json

# Runs src/train.py (argv after `-c CODE`) where importing jsonschema fails and leaves the file `tried` behind.
WITHOUT_JSONSCHEMA = """
import importlib.abc, runpy, sys
from pathlib import Path

tried = Path(sys.argv[1])

class NoJsonschema(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "jsonschema":
            tried.write_text(name)
            raise ImportError("jsonschema is blocked in this test")
        return None

sys.meta_path.insert(0, NoJsonschema())
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def write_fsdp_file(folder, *flags) -> dict:
    folder.mkdir(exist_ok=True)
    out = folder / "fsdp.json"
    result = CliRunner().invoke(cli, ["fsdp", *flags, "--output", str(out)])
    assert result.exit_code == 0, result.output
    return read_json(out)


def test_a_file_as_read_json_returns_it_passes_the_fast_check(tmp_path):
    data = write_fsdp_file(tmp_path)
    assert type(data) is not dict  # a dict that remembers keys given twice
    assert conforms(data, load_schema("fsdp"))


def test_fsdp_run_never_imports_jsonschema(tmp_path):
    """A one-process FSDP run (gloo) of the tiny model, its FSDP file as `distsetup fsdp` writes it."""
    fsdp_file = write_fsdp_file(tmp_path / "cli")
    training = {"max_steps": 2, "micro_batch_size": 4, "log_interval": 1, "checkpoint_interval": 2, "precision": "fp32"}
    config = write_config(tmp_path, "fsdp", "fsdp", fsdp_file, training, data={"num_samples": 64})
    tried = tmp_path / "jsonschema_imported"
    command = [sys.executable, "-c", WITHOUT_JSONSCHEMA, str(tried), str(REPO / "src" / "train.py")]
    result = subprocess.run(
        [*command, "--config", str(config)], capture_output=True, text=True, timeout=180, env=environment(), cwd=REPO
    )
    assert not tried.exists(), f"imported {tried.read_text()}:\n{result.stderr[-2000:]}"
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "backend fsdp (FULL_SHARD)" in result.stdout, result.stdout
    assert len(losses(tmp_path / "out")) == 2
