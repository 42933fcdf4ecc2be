"""Every `bash` block of the getting-started page (which holds the README's quick start) runs as written, in order,
in an empty folder (a block written ```bash {.no-run} is left out, and the page says why).

The runs stay short through the environment alone (DISTSETUP_MAX_STEPS caps the trainer's steps), so the commands
run are the ones a reader types. The rest of the site is checked by `make docs` (mkdocs build --strict, with
mkdocs.yml's validation: a broken link or anchor, or a page missing from the nav, fails it).
"""

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml
from documents import GETTING_STARTED, MAX_STEPS, commands, runnable_blocks

from distsetup.formats.validate import validate_file


def test_the_getting_started_page_runs_as_written(tmp_path):
    """Its blocks hold the README's quick start, in order (tests/unit/test_docs_agree.py): one run tests both."""
    document, blocks = "getting-started", runnable_blocks(GETTING_STARTED.read_text())
    assert blocks, f"{document}: no bash block to run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # a fresh machine, not a job's
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # this venv's distsetup and torchrun
    env["DISTSETUP_MAX_STEPS"] = str(MAX_STEPS)
    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", "\n".join(blocks)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"{document} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"

    # `distsetup init` prints one command to run next: the document gives that command
    printed = re.search(r"^Next: (.+)$", run.stdout, re.M)
    assert printed, run.stdout[-2000:]
    assert shlex.split(printed.group(1)) in commands(blocks), f"init printed `{printed.group(1)}`; {document} says"

    # every file the commands wrote is valid as `distsetup validate` judges it
    written = sorted((tmp_path / "config").iterdir())
    assert tmp_path / "config" / "config.yaml" in written
    for path in written:
        found = validate_file(path)
        assert not found.problems, (path.name, [str(p) for p in found.problems])

    # the run trained: its summary, a finite loss in the metrics, a complete checkpoint at the last step
    config = yaml.safe_load((tmp_path / "config" / "config.yaml").read_text())
    output = tmp_path / config["training"]["output_dir"]
    summary = json.loads((output / "summary.json").read_text())
    assert summary["steps"] == MAX_STEPS, summary["steps"]
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] > 0, summary["final_loss"]
    losses = [json.loads(line).get("loss") for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert losses and all(isinstance(x, float) and math.isfinite(x) for x in losses if x is not None), losses
    assert (output / "checkpoints" / f"step_{MAX_STEPS:07d}" / "COMPLETE").is_file()
