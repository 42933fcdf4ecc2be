"""No pipeline in a generated script dies of SIGPIPE: a SLURM script survives a list of 4,000 hosts, and no
template pipes into a reader that stops early."""

import pytest
from repo import REPO
from shell_checks import fake_tools, run_script

from distsetup.scripts.launch_plan import LaunchSpec
from distsetup.scripts.sbatch import SlurmSpec, build_slurm_script

# --- no pipeline in a generated script dies of SIGPIPE ----------------------------------------------

# Writes 4,000 host names in four writes with a pause between: a reader that stops after the first line
# (head -n1) is gone by the second write, which then kills scontrol with SIGPIPE.
FAKE_SCONTROL = """#!/bin/bash
if [[ "$1 $2" == "show hostnames" ]]; then
  for chunk in 0 1 2 3; do
    printf 'gpu%05d\\n' $(seq $((chunk * 1000)) $((chunk * 1000 + 999)))
    sleep 0.2
  done
fi
"""


@pytest.mark.parametrize("method", ["torchrun", "deepspeed"])
def test_slurm_script_survives_a_long_host_list(tmp_path, method):
    spec = SlurmSpec(
        launch=LaunchSpec(
            num_nodes=4000,
            nproc_per_node=8,
            config="config.yaml",
            launch_method=method,
            rdzv_backend="c10d" if method == "torchrun" else "static",
        )
    )
    text = build_slurm_script(spec, command_line="distsetup slurm ...")
    fake = fake_tools(tmp_path)
    (fake / "scontrol").write_text(FAKE_SCONTROL)
    (fake / "scontrol").chmod(0o755)
    env = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "4000", "SLURM_JOB_NODELIST": "gpu[00000-03999]"}
    (tmp_path / "config.yaml").write_text("training:\n  max_steps: 2\n")  # the script checks it before srun
    result = run_script(text, tmp_path, "srun", env=env, show_env=("MASTER_ADDR",), cwd=tmp_path)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    assert "MASTER_ADDR=gpu00000" in result.stdout


def test_no_template_pipes_into_a_reader_that_stops_early():
    """`cmd | head`, `| grep -q`, `| grep -m`: the reader exits before cmd is done; under pipefail, 141."""
    templates = sorted((REPO / "templates").glob("*.j2"))
    assert templates, f"no *.j2 template in {REPO / 'templates'}: nothing was checked"
    for template in templates:
        for number, line in enumerate(template.read_text().splitlines(), 1):
            pipes = [] if line.lstrip().startswith(("#", "{#")) else line.split("|")[1:]
            assert not any(
                p.split()[:1] == ["head"] or p.split()[:2] in (["grep", "-q"], ["grep", "-m"]) for p in pipes
            ), f"{template.name}:{number}: {line}"
