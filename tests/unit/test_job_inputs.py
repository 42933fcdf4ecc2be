"""What `distsetup job` takes from its user, offline: flags that are one line and write nothing, --env and what it
may not set (the scripts', the engines', torchrun's, a flag's), an image reference, the arguments after `--` (on every
node; an output_dir kept where the job keeps its checkpoints), and the examples its --help shows."""

import os
import re
import shlex

import pytest
import yaml
from hostile_input import one_line_error
from job_projects import CONFIG, SKYPILOT, job_project, write
from repo import run_subprocess_cli
from shell_checks import shellcheck

from distsetup.scripts.launch_flags import SCRIPT_VARIABLES


@pytest.fixture
def project(tmp_path, monkeypatch):
    return job_project(tmp_path, monkeypatch)


@pytest.mark.parametrize(
    "extra, words",
    [
        (("--image", ""), ("--image is empty",)),
        (("--image", "ghcr.io/Me/train:1.0"), ("--image 'ghcr.io/Me/train:1.0' is not an image reference",)),
        (("--image", "train:1.0 "), ("--image 'train:1.0 '", "image reference")),  # the API server refuses it
        (("--name", "n" * 49), ("--name", "at most 48 characters")),
        (("--name", "1run"), ("--name", "DNS label")),
        (("--grace_seconds", 60, "--checkpoint_seconds", 45), ("--grace_seconds 60", "give --grace_seconds 75")),
        (("--num_gpus_per_node", "auto"), ("--num_gpus_per_node", "not auto")),
        (("--launch_method", "deepspeed"), ("--launch_method deepspeed", "torchrun")),
        (("--target", "slurm"), ("--target",)),
        (("--master_port", 30000), ("--master_port", "29500")),
        (("--env", "NNODES=5"), ("--env NNODES", "--num_nodes")),  # the entry point's own: a world it would not form
        (("--use_spot",), ("--use_spot", "SkyPilot flag")),
        (("--checkpoint_bucket", "s3://b"), ("--checkpoint_bucket", "SkyPilot flag")),
        (("--namespace", "my ns"), ("--namespace 'my ns'", "DNS label")),
        (("--shm_size", "16 GB"), ("--shm_size '16 GB'", "a size in bytes")),
        (("--shm_size", "16"), ("--shm_size '16'", "a size in bytes")),  # Kubernetes: 16 bytes
        (("--checkpoint_storage", "512m"), ("--checkpoint_storage '512m'", "e.g. --checkpoint_storage 16Gi")),
        (("--gpu_resource", "nvidia gpu"), ("--gpu_resource", "resource name")),
        (("--checkpoint_claim", "Bad_Claim"), ("--checkpoint_claim", "DNS subdomain")),
        (("--gpu_resource", "gpu"), ("--gpu_resource", "extended resource")),  # no domain: not a device's
        (("--checkpoint_storage", "-1Gi"), ("--checkpoint_storage", "a size in bytes")),
        (("--shm_size", "0Gi"), ("--shm_size", "a size in bytes")),
        (
            ("--checkpoint_claim", "runs", "--checkpoint_storage", "5Gi"),
            ("--checkpoint_storage shapes the claim distsetup writes",),
        ),
    ],
    ids=[
        "image",
        "capital image",
        "image space",
        "long name",
        "name",
        "grace",
        "auto",
        "launcher",
        "target",
        "port",
        "env",
    ]
    + ["spot", "bucket", "namespace", "shm", "shm bare", "storage milli", "resource", "claim", "no domain"]
    + ["negative", "shm zero", "claim sized"],
)
def test_bad_flags_are_one_line_and_write_nothing(run_cli, project, extra, words):
    result = write(run_cli, "trainjob", *extra, nodes=2)
    one_line_error(result, *words)
    assert not (project / "k8s").exists()


# Scripts that take --env, written as every launcher and engine writes them
ENV_TAKING_SCRIPTS = {
    "slurm torchrun": ("slurm", "--requeue", "--python_module", "train"),
    "slurm deepspeed": ("slurm", "--launch_method", "deepspeed", "--script", "train.py"),
    "slurm accelerate": ("slurm", "--launch_method", "accelerate", "--use_deepspeed", "--deepspeed_config", "ds.json"),
    "jobset": ("job", "--target", "jobset", "--image", "i:1", "--script", "train.py"),
    "skypilot": ("job", "--target", "skypilot", *SKYPILOT, "--python_module", "train"),
}


# An assignment: at a line's start or after && / ||, with export or local, or mapfile's
ASSIGNMENT = re.compile(r"(?:^\s*|&& |\|\| )(?:export |local )?([A-Z][A-Z0-9_]*)=|mapfile -t ([A-Z][A-Z0-9_]*)", re.M)


def test_env_may_not_set_what_the_scripts_set_themselves(run_cli, project):
    """Every variable the scripts that take --env assign (slurm_job.sh, the entry point) is one --env refuses, as its
    export would change the world they start or the program they run. ACCELERATE_USE_CPU and PYTHONPATH are the
    user's to set: the scripts set the one only where it is unset and add to the other."""
    (project / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 2}')
    assigned = set()
    for name, args in ENV_TAKING_SCRIPTS.items():
        result = run_cli(*args, "--config", "config.yaml", "--num_gpus_per_node", 8, "--num_nodes", 2, "-o", "-")
        assert result.exit_code == 0, (name, result.output)
        assigned |= {a or b for a, b in ASSIGNMENT.findall(result.stdout)}
    assert {"NNODES", "WORKDIR", "TRAIN_ARGS", "PYTHON", "DEEPSPEED_CONFIG", "HOSTFILE"} <= assigned
    assert assigned - {"IFS", "ACCELERATE_USE_CPU", "PYTHONPATH"} <= SCRIPT_VARIABLES.keys()
    one_line_error(run_cli("slurm", "--env", "MASTER_PORT=1", "-o", "job.sh"), "--env MASTER_PORT", "--master_port")
    assert not (project / "job.sh").exists()


@pytest.mark.parametrize(
    "target, variable, words",
    [
        ("jobset", "JOB_COMPLETION_INDEX=0", "Kubernetes (an indexed Job's pod index) sets JOB_COMPLETION_INDEX"),
        ("trainjob", "PET_NODE_RANK=0", "Kubeflow (its torchrun settings) sets PET_NODE_RANK"),
        ("pytorchjob", "RANK=0", "torchrun (each rank's) sets RANK"),
        ("skypilot", "SKYPILOT_NODE_RANK=0", "SkyPilot sets SKYPILOT_NODE_RANK"),
    ],
)
def test_env_may_not_set_what_the_engine_or_torchrun_sets(run_cli, project, target, variable, words):
    """An export of the engine's own variable did nothing, or (JOB_COMPLETION_INDEX) made every pod node rank 0."""
    extra = SKYPILOT if target == "skypilot" else ("--image", "ghcr.io/me/train:1")
    args = ["job", "--target", target, "--config", "config.yaml", "--num_gpus_per_node", 8, *extra]
    one_line_error(run_cli(*args, "--env", variable, "-o", "out.yaml"), f"--env {variable.split('=')[0]}", words)
    assert not (project / "out.yaml").exists()


def test_env_takes_what_the_engines_only_read(run_cli, project):
    """srun's and torchrun's own input (SLURM_CPU_BIND, PET_TEE) is the user's to set; the engines do not set it."""
    result = run_cli(
        "slurm", "--config", "config.yaml", "--env", "SLURM_CPU_BIND=cores", "--env", "PET_TEE=3", "-o", "-"
    )
    assert result.exit_code == 0, result.output
    assert "export SLURM_CPU_BIND=cores" in result.stdout and "export PET_TEE=3" in result.stdout
    for bad in ("training.output_dir=null", "training.output_dir='runs"):  # one line, not a traceback
        args = ["job", "--target", "skypilot", "--config", "config.yaml", "--num_gpus_per_node", 8, *SKYPILOT]
        one_line_error(run_cli(*args, "-o", "-", "--", bad), "training.output_dir")


@pytest.mark.parametrize("target", ["jobset", "skypilot"])
def test_text_outside_ascii_stays_as_written_and_the_scripts_stay_block_text(run_cli, project, target):
    """An --env value outside ASCII escaped the whole entry script into one quoted line of the manifest."""
    extra = SKYPILOT if target == "skypilot" else ("--image", "ghcr.io/me/train:1")
    args = ["job", "--target", target, "--config", "config.yaml", "--num_gpus_per_node", 8, *extra]
    result = run_cli(*args, "--env", "GREETING=ünï", "-o", "out.yaml", "--", "training.output_dir=runs/é😀")
    assert result.exit_code == 0, result.output
    text = (project / "out.yaml").read_text(encoding="utf-8")
    assert "export GREETING='ünï'  # set with --env\n" in text  # a line of the script's block text, unescaped
    assert '/runs/é😀"' in text  # the output folder kept in the volume: JSON's \\ud83d\\ude00 read back as two halves
    scripts = [v for doc in yaml.safe_load_all(text) for v in walk_strings(doc) if "export GREETING" in v]
    assert scripts and all("\n" in script for script in scripts)  # the script itself, read back whole


def test_files_are_written_as_utf8_whatever_the_locale(project):
    """Under an ASCII locale (LC_ALL=POSIX, no UTF-8 mode) a run config's comment outside ASCII ended the command in
    a UnicodeEncodeError traceback, the manifest unwritten."""
    (project / "config.yaml").write_text("# données\n" + (project / "config.yaml").read_text(), encoding="utf-8")
    ascii_locale = {**os.environ, "LC_ALL": "POSIX", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    args = ["job", "--target", "jobset", "--config", "config.yaml", "--num_gpus_per_node", 8, "--image", "i:1"]
    result = run_subprocess_cli(*args, "-o", "out.yaml", cwd=project, env=ascii_locale)
    assert result.returncode == 0, result.stderr
    assert "# données" in (project / "out.yaml").read_text(encoding="utf-8")


def walk_strings(node):
    if isinstance(node, dict):
        for value in node.values():
            yield from walk_strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk_strings(value)
    elif isinstance(node, str):
        yield node


def test_a_pods_data_and_code_are_the_images_not_looked_for_here(run_cli, project):
    """docs/kubernetes.md says to name data on a volume as /workspace/data/train.txt: the job was refused, as that
    file (and a builder module of the image) is not on this machine. SkyPilot's workdir is this folder: looked for."""
    pod_files = {"model": {"type": "python", "builder": "mypkg.models:build"}}
    pod_files["data"] = {"type": "files", "paths": ["/workspace/data/train.txt"]}
    (project / "pod.yaml").write_text(yaml.safe_dump({**CONFIG, **pod_files}))
    args = ["job", "--config", "pod.yaml", "--num_gpus_per_node", 8, "-o", "-"]
    result = run_cli(*args, "--target", "jobset", "--image", "ghcr.io/me/train:1")
    assert result.exit_code == 0, result.output
    one_line_error(run_cli(*args, "--target", "skypilot", *SKYPILOT), "run config problem in pod.yaml: model.builder")


@pytest.mark.parametrize("target", ["jobset", "skypilot"])
def test_the_trainers_arguments_are_read_as_it_reads_them_before_the_job_is_written(run_cli, project, target):
    """A typo after `--` was written into the job: every node's check refused it, and the engine restarted them."""
    extra = SKYPILOT if target == "skypilot" else ("--image", "ghcr.io/me/train:1")
    args = ["job", "--target", target, "--config", "config.yaml", "--num_gpus_per_node", 8, *extra, "-o", "out.yaml"]
    said = one_line_error(run_cli(*args, "--", "training.max_stepz=5"), "after --: training.max_stepz: unknown key")
    assert "did you mean 'max_steps'" in said and not (project / "out.yaml").exists()
    one_line_error(run_cli(*args, "--", "training.max_steps=abc"), "training.max_steps: 'abc' has the wrong type")
    one_line_error(run_cli(*args, "--", "--bogus"), "the trainer's arguments after --: unrecognized arguments: --bogus")
    one_line_error(run_cli(*args, "--", "distributed.backend=deepspeed"), "the job's backend is its flags'")
    one_line_error(run_cli(*args, "--", "--deepspeed", "ds.json"), "--deepspeed ds.json after --: the job's backend")
    assert not (project / "out.yaml").exists()
    # read as the trainer reads them: an option's value is no override, and files are the pod's to find
    fine = ["training.max_steps=5", "--no_resume", "--init_from", "runs/a=b/model.pt", "data.paths=[/workspace/d.txt]"]
    assert run_cli(*args, "--", *fine).exit_code == 0


def test_env_and_the_flag_of_one_variable_are_refused_together(run_cli, project):
    """--env OMP_NUM_THREADS=8 beside --omp_num_threads 4: two exports, the later silently the one."""
    args = ["job", "--target", "jobset", "--config", "config.yaml", "--num_gpus_per_node", 8, "--image", "i:1"]
    both = run_cli(*args, "--env", "OMP_NUM_THREADS=8", "--omp_num_threads", 4, "-o", "out.yaml")
    one_line_error(both, "--env OMP_NUM_THREADS=... and --omp_num_threads both set OMP_NUM_THREADS")
    assert run_cli(*args, "--env", "OMP_NUM_THREADS=8", "-o", "out.yaml").exit_code == 0


def test_the_skypilot_flags_the_hint_gives_work_when_copied(run_cli, project):
    """The hint's example named --image IMAGE, which the command then refused."""
    base = ["job", "--target", "skypilot", "--config", "config.yaml", "--num_gpus_per_node", 8]
    hint = run_cli(*base).output.split("HINT: e.g. ")[1]
    copied = shlex.split(re.sub(r" \([^()]*\)", "", hint).rstrip(".\n"))  # the example without its asides
    assert "--setup" in copied
    assert run_cli(*base, *copied, "-o", "-").exit_code == 0


@pytest.mark.parametrize(
    "extra, words",
    [
        ((), ("needs --accelerator, --checkpoint_bucket and --image or --setup.",)),  # all at once, not run by run
        (("--checkpoint_bucket", "s3://b/runs"), ("--accelerator", "H100")),
        (("--accelerator", "H100", "--checkpoint_bucket", "/mnt/runs"), ("--checkpoint_bucket", "s3://")),
        (SKYPILOT + ("--config", "OUTSIDE"), ("SkyPilot copies",)),
        (SKYPILOT + ("--config", "RELATIVE"), ("SkyPilot copies",)),
        (("--accelerator", "H100", "--checkpoint_bucket", "s3://b"), ("--image or --setup",)),  # installs nothing
        (("--accelerator", "H100;rm", "--checkpoint_bucket", "s3://b", "--setup", "x"), ("--accelerator", "GPU type")),
        (SKYPILOT + ("--namespace", "team-a"), ("--namespace", "Kubernetes flag")),
        (SKYPILOT + ("--gpu_resource", "none"), ("--gpu_resource", "Kubernetes flag")),
        (SKYPILOT + ("--shm_size", "16Gi"), ("--shm_size", "Kubernetes flag")),  # its default value, given
    ],
    ids=[
        "none",
        "accelerator",
        "bucket",
        "outside",
        "relative outside",
        "no software",
        "gpu type",
        "namespace",
        "gpus",
        "shm",
    ],
)
def test_bad_skypilot_flags_are_one_line_and_write_nothing(run_cli, project, extra, words):
    outside = project.parent / f"{project.name}-outside.yaml"  # beside the folder SkyPilot would copy
    outside.write_text(yaml.safe_dump(CONFIG))
    paths = {"OUTSIDE": str(outside), "RELATIVE": f"../{outside.name}"}
    extra = [paths.get(arg, arg) for arg in extra]
    result = run_cli("job", "--target", "skypilot", "--config", "config.yaml", "--num_gpus_per_node", 8, *extra)
    one_line_error(result, *words)
    assert not (project / "sky").exists()


def test_arguments_after_a_double_dash_reach_the_program_on_every_node(run_cli, project):
    """`distsetup job ... -- ARGS`: the trainer's overrides (or an own script's arguments) on every node, quoted, and
    in the command the file says regenerates it."""
    args = ["job", "--target", "skypilot", "--config", "config.yaml", "--num_gpus_per_node", 8, *SKYPILOT]
    result = run_cli(*args, "--", "training.max_steps=5", "data.text_field=a b$c")
    assert result.exit_code == 0, result.output
    (task,) = yaml.safe_load_all((project / "sky" / "task.yaml").read_text())
    assert "TRAIN_ARGS+=(training.max_steps=5 'data.text_field=a b$c')" in task["run"]
    assert "-- training.max_steps=5 'data.text_field=a b$c'\n" in task["run"]  # the header's regenerate command
    entry = project / "run.sh"
    entry.write_text(task["run"])
    shellcheck([entry])


def test_the_help_examples_run_as_written(run_cli, project):
    """The first thing a user copies: each `distsetup job` example of --help writes its files."""
    epilog = run_cli("job", "--help").stdout.split("Examples:")[1].replace("\\\n", " ")  # continued lines: one
    examples = [line for line in epilog.splitlines() if "distsetup job" in line]
    assert len(examples) == 3
    for example in examples:
        result = run_cli(*shlex.split(example)[1:], "-o", "-")
        assert result.exit_code == 0, (example, result.output)


SCRIPTS_WORDS = {  # what the launch scripts' options say, and which command says it
    "the deepspeed launcher, or accelerate": ("launcher", "slurm"),
    "or auto (every visible GPU)": ("launcher",),
    "[auto, or the count of --gpus]": ("launcher",),
    "the GPUs each node asks SLURM for": ("slurm",),
    "under SLURM derived from the job id": ("launcher", "slurm"),
    "Print the script": ("launcher", "slurm"),
    "--launch-method torchrun The only launcher a job runs": ("job",),
}


@pytest.mark.parametrize("command", ["job", "launcher", "slurm"])
def test_the_shared_options_help_says_what_the_command_does_with_them(run_cli, command):
    """`job --help` read the launch scripts' texts: --launch_method offered the deepspeed launcher and accelerate, and
    --num_gpus_per_node auto and --gpus, which a job refuses or lacks; --master_port spoke of SLURM, --dry_run of a
    script. `slurm --help` offered auto and --gpus too, which it refuses or lacks."""
    help_text = " ".join(run_cli(command, "--help").stdout.split())
    said = {words for words in SCRIPTS_WORDS if words in help_text}
    assert said == {words for words, commands in SCRIPTS_WORDS.items() if command in commands}


@pytest.mark.parametrize("output_dir, in_bucket", [("runs/exp2", True), ("/tmp/exp2", False)])
def test_an_output_dir_given_after_the_double_dash_is_kept_where_the_job_keeps_it(
    run_cli, project, output_dir, in_bucket
):
    """SkyPilot: a relative output_dir given after `--` goes into the bucket, as the run config's does (it went to the
    node's disk, lost on a spot recovery); an absolute one elsewhere is the user's, with a note that it is lost."""
    args = ["job", "--target", "skypilot", "--config", "config.yaml", "--num_gpus_per_node", 8, *SKYPILOT]
    result = run_cli(*args, "--", f"training.output_dir={output_dir}")
    assert result.exit_code == 0, result.output
    (task,) = yaml.safe_load_all((project / "sky" / "task.yaml").read_text())
    train_args = [line for line in task["run"].splitlines() if line.startswith("TRAIN_ARGS+=")]
    last = train_args[-1]  # the last override of a key is the one the trainer takes
    assert ("/distsetup-work/runs/exp2" in last) == in_bucket, train_args
    assert in_bucket or not any("/distsetup-work" in line for line in train_args), train_args
    assert ("is outside /distsetup-work (the bucket): its checkpoints go with the node" in result.output) != in_bucket


def test_a_token_cache_of_the_run_configs_own_is_kept_where_every_node_sees_it(run_cli, project):
    """A relative data.cache_dir: rank 0 writes the token cache, every rank reads it; in the folder a pod starts in
    (the image's) a node but the first saw none. It goes on the shared volume, as the output does."""
    args = ["job", "--target", "jobset", "--config", "config.yaml", "--num_nodes", 2, "--num_gpus_per_node", 8]
    result = run_cli(*args, "--image", "ghcr.io/me/train:1", "-o", "job.yaml", "--", "data.cache_dir=cache")
    assert result.exit_code == 0, result.output
    entry = next(d for d in yaml.safe_load_all((project / "job.yaml").read_text()) if d["kind"] == "ConfigMap")
    kept = [line for line in entry["data"]["entry.sh"].splitlines() if line.startswith("TRAIN_ARGS+=")][-1]
    assert kept == "TRAIN_ARGS+=('training.output_dir=\"/workspace/runs/demo\"' 'data.cache_dir=\"/workspace/cache\"')"


@pytest.mark.parametrize(
    "image, valid",
    [("[::1]:5000/train:1", True), ("localhost:5000/a/b@sha256:" + "0" * 64, True), ("train:tagé", False)],
)
def test_an_image_reference_is_read_by_the_registries_grammar(image, valid):
    from distsetup.jobs.forms import IMAGE

    assert IMAGE.fits(image) == valid
