"""The `distsetup launcher` command: what it writes and says, its flags and their old spellings, bad input that
writes nothing, file names YAML would misread, and relative paths that hold when the script runs from another
folder."""

import json
import os
import stat
import subprocess
import sys

import pytest
from launch_inputs import DS_CONFIG, FSDP_CONFIG
from shell_checks import fake_tools, run_script

# --- the command ---------------------------------------------------------------------------------


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A folder with config.yaml and config/ds_config.json (batch 8 = 4 x 1 x world 2); the cwd."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "ds_config.json").write_text(json.dumps(DS_CONFIG))
    (tmp_path / "config.yaml").write_text(
        "distributed:\n  backend: deepspeed\n  deepspeed_config: config/ds_config.json\n"
    )
    return tmp_path


def test_writes_an_executable_script_and_says_what_next(run_cli, project):
    result = run_cli("launcher", "--config", "config.yaml", "--num_gpus_per_node", "2")
    assert result.exit_code == 0, result.output
    script = project / "scripts" / "run_training.sh"
    assert script.stat().st_mode & stat.S_IXUSR
    assert "Next: bash scripts/run_training.sh" in result.stderr
    text = script.read_text()
    # the run config's own backend and file are read from it when the run starts: an edit of it takes effect (the
    # script passed distributed.backend=deepspeed --deepspeed FILE, and a run config edited to fsdp trained ZeRO)
    assert "TRAIN_ARGS=(--config config.yaml)" in text and "distributed.backend=" not in text
    assert "#   distsetup launcher --config config.yaml --num_gpus_per_node 2" in text


def test_the_next_step_printed_by_distsetup_deepspeed_works(run_cli, project):
    result = run_cli("launcher", "--use_deepspeed", "--deepspeed_config", "config/ds_config.json")
    assert result.exit_code == 0, result.output
    assert "--deepspeed config/ds_config.json" in (project / "scripts" / "run_training.sh").read_text()


def test_dash_spellings_and_dry_run(run_cli, project):
    result = run_cli("launcher", "--num-gpus-per-node", "2", "--use-fsdp", "--dry-run", "--launch-method", "torchrun")
    assert result.exit_code == 0, result.output
    assert "distributed.backend=fsdp" in result.stdout
    assert not (project / "scripts").exists()


def test_flags_override_the_configs_backend(run_cli, project):
    result = run_cli("launcher", "--config", "config.yaml", "--use_fsdp", "--num_gpus_per_node", "2", "-o", "-")
    assert result.exit_code == 0, result.output
    assert "distributed.backend=fsdp" in result.stdout and "--deepspeed" not in result.stdout


def test_a_backends_file_alone_names_its_backend(run_cli, project):
    """--fsdp_config without --use_fsdp trained DDP, the file unread, without a word."""
    assert run_cli("fsdp", "--output", "f.json").exit_code == 0
    result = run_cli("launcher", "--config", "config.yaml", "--fsdp_config", "f.json", "-o", "-")
    assert result.exit_code == 0, result.output
    assert "distributed.backend=fsdp" in result.stdout and "distributed.fsdp_config=" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num_nodes", "0"], "--num_nodes 0 must be at least 1"),
        (["--num_gpus_per_node", "0"], "--num_gpus_per_node 0 must be at least 1"),
        (["--num_nodes", "2", "--node_rank", "2"], "--node_rank 2 is out of range for --num_nodes 2"),
        (
            ["--num_gpus_per_node", "3"],
            "8 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 1 x world size 3 = 12",
        ),
        (["--num_nodes", "2", "--num_gpus_per_node", "2", "--master_addr", "h0"], "world size 4 = 16"),
        (["--use_deepspeed", "--use_fsdp"], "mutually exclusive"),
        # the backend not trained with lost its file without a word
        (["--use_fsdp", "--deepspeed_config", "ds.json"], "--deepspeed_config and --use_fsdp name two backends"),
        (["--deepspeed_config", "ds.json", "--fsdp_config", "f.json"], "and --fsdp_config name two backends"),
        (["--gpus", "0,x"], "is not a list of GPU indices"),
        (["--num_gpus_per_node", "many"], "neither a number nor auto"),
        (
            ["--gpus", "2,3", "--launch_method", "deepspeed", "--num_nodes", "2", "--master_addr", "h0"],
            "use --launch_method torchrun",
        ),
        (["--deepspeed_config", "nope.json"], "--deepspeed_config nope.json: file nope.json does not exist"),
        (["--use_fsdp", "--fsdp_config", "nope.json"], "--fsdp_config nope.json: file nope.json does not exist"),
        # the header and the Next: line name it on one line: its second half was live bash in the usage comment
        (["-o", "scripts/run\nx.sh"], "--output 'scripts/run\\nx.sh' contains a control character"),
    ],
)
def test_bad_input_is_an_error_and_writes_nothing(run_cli, project, args, message):
    result = run_cli("launcher", "--config", "config.yaml", *args)
    assert result.exit_code != 0
    assert message in result.output
    assert not (project / "scripts").exists()


def test_gpus_auto_uses_distsetup_gpus(run_cli, project, monkeypatch):
    import distsetup.planning.gpus

    monkeypatch.setattr(distsetup.planning.gpus, "select_gpus", lambda count, **kw: [3, 1][:count])
    result = run_cli("launcher", "--use_fsdp", "--gpus", "auto:2", "-o", "-")
    assert result.exit_code == 0, result.output
    assert "export CUDA_VISIBLE_DEVICES=3,1" in result.stdout and "NPROC_PER_NODE=2" in result.stdout
    assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID" in result.stdout  # NVML's indices are in PCI bus order


def train_py_config(argv: list[str]):
    """The run config distsetup's trainer builds from `argv`, through its own parse_args and load_config."""
    from distsetup import train  # no torch: the trainer imports it inside train()

    return train.load_config(train.parse_args(argv))


def script_argv(result) -> list[str]:
    """What the script hands to distsetup's trainer, from a fake launcher's printed argv."""
    assert result.returncode == 0, result.stderr
    argv = result.stdout.splitlines()
    return argv[argv.index("distsetup.train") + 1 :]


# File names YAML would misread: an alias (@), a flow list ([), a mapping (: ), a comment (#), a boolean.
YAML_TRAPS = ["@ds.json", "[x].json", "a: b.json", "#x.json", "a #b.json", "yes", "sp ace 'q\" $x.json"]


@pytest.mark.parametrize("kind", ["deepspeed", "fsdp"])
@pytest.mark.parametrize("name", YAML_TRAPS)
def test_file_names_yaml_would_misread_reach_train_py(run_cli, tmp_path, monkeypatch, name, kind):
    """Bug: --deepspeed_config / --fsdp_config went through YAML parsing (in the command and in train.py):
    tracebacks, or `yes` read as true. The generated script now hands train.py exactly the file named."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text("distributed: {backend: ddp}\n")
    (tmp_path / name).write_text(json.dumps(DS_CONFIG if kind == "deepspeed" else FSDP_CONFIG))
    result = run_cli(
        "launcher",
        "--config",
        "config.yaml",
        f"--use_{kind}",
        f"--{kind}_config",
        name,
        "--num_gpus_per_node",
        "2",
        "-o",
        "run.sh",
    )
    assert result.exit_code == 0, result.output
    cfg = train_py_config(script_argv(run_script(tmp_path / "run.sh", tmp_path, cwd=tmp_path)))
    assert cfg.distributed.backend == kind
    assert getattr(cfg.distributed, f"{kind}_config") == name


def test_auto_values_are_refused_for_train_py(run_cli, project):
    """Bug: a DeepSpeed file with "auto" (HF Trainer only) was accepted for the trainer; every rank failed."""
    (project / "hf.json").write_text(json.dumps({**DS_CONFIG, "gradient_accumulation_steps": "auto"}))
    result = run_cli("launcher", "--deepspeed_config", "hf.json", "--num_gpus_per_node", "2", "-o", "-")
    assert result.exit_code != 0
    assert "gradient_accumulation_steps" in result.output and "Hugging Face Trainer" in result.output
    mine = run_cli(
        "launcher", "--deepspeed_config", "hf.json", "--num_gpus_per_node", "2", "--script", "hf.py", "-o", "-"
    )
    assert mine.exit_code == 0, mine.output  # a user's script may be the HF Trainer


def test_accelerate_gets_the_deepspeed_file_resolved_next_to_the_config(run_cli, tmp_path, monkeypatch):
    """Bug: a path relative to the config's folder went to accelerate unresolved (it resolves against cwd)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "ds.json").write_text(json.dumps(DS_CONFIG))
    (tmp_path / "sub" / "config.yaml").write_text("distributed: {backend: deepspeed, deepspeed_config: ds.json}\n")
    result = run_cli(
        "launcher",
        "--config",
        "sub/config.yaml",
        "--launch_method",
        "accelerate",
        "--num_gpus_per_node",
        "2",
        "-o",
        "run.sh",
    )
    assert result.exit_code == 0, result.output
    fake = fake_tools(tmp_path, "accelerate")
    (fake / "accelerate").write_text(
        '#!/bin/bash\nwhile [[ "$1" != --deepspeed_config_file ]]; do shift; done\n[[ -f "$2" ]] && echo "found $2"\n'
    )
    run = run_script(tmp_path / "run.sh", tmp_path, "accelerate", cwd=tmp_path)
    assert run.stdout == "found sub/ds.json\n", run.stdout + run.stderr


def accelerate_argv(run_cli, tmp_path, *args) -> tuple[list[str], str]:
    """What `accelerate launch` is given by the script of `distsetup launcher --launch_method accelerate ARGS`, and
    what the launcher said."""
    written = run_cli("launcher", "--launch_method", "accelerate", "-o", tmp_path / "run.sh", *args)
    assert written.exit_code == 0, written.output
    run = run_script(tmp_path / "run.sh", tmp_path, "accelerate", env={"ACCELERATE_USE_CPU": "false"}, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines(), written.stderr


def test_accelerate_carries_the_deepspeed_file_told_no_precision_of_its_own_and_a_users_program_gets_no_flag(
    run_cli, tmp_path, monkeypatch
):
    """Bugs: a program of the user's got `--deepspeed FILE`, which a plain Accelerate program's parser refuses
    (accelerate launch carries the file, and the HF Trainer reads it from there too); and accelerate launch, told no
    precision, took its default config's, then refused the file ("the following accelerate config variables will be
    ignored"). It is told `no` whatever the file says, then or later ("auto" too): under DeepSpeed the file decides
    (AcceleratorState.mixed_precision), and accelerate refuses a flag that names another 16-bit type than the
    file's. A file that names an optimizer gets a note: accelerator.prepare refuses the program's own."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text("")
    (tmp_path / "ds.json").write_text(
        json.dumps({**DS_CONFIG, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW"}})
    )
    mine, said = accelerate_argv(
        run_cli, tmp_path, "--script", "mine.py", "--use_deepspeed", "--deepspeed_config", "ds.json",
        "--num_gpus_per_node", 2,
    )  # fmt: skip
    assert mine[mine.index("--deepspeed_config_file") + 1] == "ds.json"
    assert mine[mine.index("--mixed_precision") + 1] == "no" and mine[-1] == "mine.py"
    assert "ds.json names a DeepSpeed optimizer: accelerator.prepare refuses one your program makes itself" in said
    (tmp_path / "ds.json").write_text(json.dumps({**DS_CONFIG, "bf16": {"enabled": "auto"}}))  # the HF Trainer's
    auto, said = accelerate_argv(
        run_cli, tmp_path, "--script", "mine.py", "--use_deepspeed", "--deepspeed_config", "ds.json",
        "--num_gpus_per_node", 2,
    )  # fmt: skip
    assert auto[auto.index("--mixed_precision") + 1] == "no" and auto[-1] == "mine.py" and "optimizer" not in said
    (tmp_path / "ds.json").write_text(json.dumps(DS_CONFIG))
    trainer, _ = accelerate_argv(
        run_cli, tmp_path, "--use_deepspeed", "--deepspeed_config", "ds.json", "--num_gpus_per_node", 2
    )
    assert trainer[trainer.index("distsetup.train") + 1 :] == [
        "distributed.backend=deepspeed",
        "--deepspeed",
        "ds.json",
    ]


@pytest.mark.parametrize("processes, multi_gpu", [(1, False), (2, True)])
def test_accelerate_is_told_multi_gpu_for_a_world_of_more_than_one_process_only(
    run_cli, tmp_path, monkeypatch, processes, multi_gpu
):
    """Bug: a world of one process got --multi_gpu, which accelerate launch refuses ("at least 2 processes")."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text("")
    argv, _ = accelerate_argv(run_cli, tmp_path, "--script", "mine.py", "--num_gpus_per_node", processes)
    assert ("--multi_gpu" in argv) is multi_gpu and argv[argv.index("--num_processes") + 1] == str(processes)


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "HYBRID_SHARD_ZERO2", "FULL_SHARD"])
def test_accelerate_gets_fsdp2_hybrid_sharding_as_its_2d_mesh_of_the_scripts_nodes(
    run_cli, tmp_path, monkeypatch, strategy
):
    """Bug: Accelerate's FSDP2 shards over one flat mesh unless given its parallelism config, so an FSDP2 file's
    hybrid sharding sharded across every node. The script gives the nodes as replicas, a node's processes as
    shards (test_launcher_runs.py: accelerate launch takes them as its ParallelismConfig), on GPUs: Accelerate
    refuses a parallelism config for CPU processes, and one with a single process a node (no shard dimension)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text("")
    assert run_cli("fsdp", "--sharding_strategy", strategy, "-o", "fsdp.json").exit_code == 0
    argv, _ = accelerate_argv(
        run_cli, tmp_path, "--script", "mine.py", "--use_fsdp", "--fsdp_config", "fsdp.json", "--num_nodes", 3,
        "--num_gpus_per_node", 2, "--master_addr", "10.0.0.1", "--node_rank", 1,
    )  # fmt: skip
    mesh = {flag: argv[argv.index(flag) + 1] for flag in argv if flag.startswith("--parallelism_config_")}
    if strategy == "FULL_SHARD":
        assert "--use_parallelism_config" not in argv and mesh == {}
    else:
        assert "--use_parallelism_config" in argv and argv[argv.index("--fsdp_version") + 1] == "2"
        assert mesh == {"--parallelism_config_dp_replicate_size": "3", "--parallelism_config_dp_shard_size": "2"}
        on_cpu = run_script(tmp_path / "run.sh", tmp_path, "accelerate", env={"ACCELERATE_USE_CPU": "True"})
        assert on_cpu.returncode == 0 and "--use_fsdp" in on_cpu.stdout and "parallelism" not in on_cpu.stdout
        one_a_node, _ = accelerate_argv(  # nothing to shard within a node: Accelerate refuses the mesh (2 x 1)
            run_cli, tmp_path, "--script", "mine.py", "--use_fsdp", "--fsdp_config", "fsdp.json", "--num_nodes", 2,
            "--num_gpus_per_node", 1, "--master_addr", "10.0.0.1", "--node_rank", 1,
        )  # fmt: skip
        assert "--use_fsdp" in one_a_node and "--use_parallelism_config" not in one_a_node


def test_accelerate_fsdp_for_a_users_program_without_the_file_is_warned_of(run_cli, tmp_path, monkeypatch):
    """accelerate launch --use_fsdp alone takes accelerate's default config's FSDP settings, else its own (FSDP1, the
    whole model one unit): a warning with the command that writes a file; distsetup's trainer shards each block
    without one."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text("")
    warned = run_cli("launcher", "--launch_method", "accelerate", "--script", "mine.py", "--use_fsdp", "-o", "run.sh")
    assert warned.exit_code == 0 and (tmp_path / "run.sh").exists()
    assert "Warning: --use_fsdp without --fsdp_config" in warned.stderr
    assert "distsetup fsdp --transformer_layer_cls_to_wrap" in warned.stderr
    trainer = run_cli("launcher", "--launch_method", "accelerate", "--use_fsdp", "-o", "run.sh")
    assert trainer.exit_code == 0 and "--use_fsdp without" not in trainer.stderr


@pytest.mark.parametrize("command", ["launcher", "slurm"])
def test_use_deepspeed_finds_config_ds_config_json(run_cli, project, command):
    """Bug: the README's quick start (the shipped config.yaml has no deepspeed_config) failed with a
    run config problem although `distsetup deepspeed --output config/ds_config.json` had written one."""
    (project / "config.yaml").write_text("distributed:\n  backend: ddp\n")
    result = run_cli(command, "--config", "config.yaml", "--num_gpus_per_node", "2", "--use_deepspeed", "-o", "-")
    assert result.exit_code == 0, result.output
    assert "using config/ds_config.json" in result.stderr
    assert (
        "TRAIN_ARGS=(--config config.yaml distributed.backend=deepspeed --deepspeed config/ds_config.json)"
        in result.stdout
    )
    (project / "config" / "ds_config.json").unlink()
    missing = run_cli(command, "--config", "config.yaml", "--num_gpus_per_node", "2", "--use_deepspeed", "-o", "-")
    assert missing.exit_code != 0 and "run config problem" not in missing.output
    assert "--deepspeed_config" in missing.output and "--output config/ds_config.json" in missing.output


def test_use_fsdp_finds_config_fsdp_config_json_or_runs_without(run_cli, project, tmp_path):
    without = run_cli("launcher", "--config", "config.yaml", "--num_gpus_per_node", "2", "--use_fsdp", "-o", "-")
    assert without.exit_code == 0, without.output
    assert "TRAIN_ARGS=(--config config.yaml distributed.backend=fsdp)" in without.stdout
    (project / "config" / "fsdp_config.json").write_text(json.dumps(FSDP_CONFIG))
    found = run_cli("launcher", "--config", "config.yaml", "--num_gpus_per_node", "2", "--use_fsdp", "-o", "run.sh")
    assert found.exit_code == 0, found.output
    assert "using config/fsdp_config.json" in found.stderr
    cfg = train_py_config(script_argv(run_script(project / "run.sh", tmp_path, cwd=project)))
    assert cfg.distributed.fsdp_config == "config/fsdp_config.json"


def test_validation_errors_come_before_warnings(run_cli, project):
    """Nit: the "no --config" warning was printed before the error that stopped the command."""
    result = run_cli("launcher", "--num_nodes", "0")
    assert result.exit_code != 0 and "--num_nodes 0 must be at least 1" in result.output
    assert "Warning" not in result.output


def test_several_nodes_without_master_addr_read_it_at_run_time(run_cli, project):
    result = run_cli("launcher", "--num_nodes", "2", "--num_gpus_per_node", "8", "--node_rank", "1", "-o", "-")
    assert result.exit_code == 0, result.output
    assert "127.0.0.1" not in result.stdout and 'MASTER_ADDR="${MASTER_ADDR:?' in result.stdout


def test_command_does_not_import_torch():
    code = (
        "import sys; from distsetup.cli.main import cli; "
        "cli(['launcher', '--num_gpus_per_node', '2', '-o', '-'], standalone_mode=False); "
        "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_relative_paths_hold_when_the_script_runs_from_another_folder(run_cli, project, tmp_path):
    """The command names files relative to where it ran; the script finds them from anywhere."""
    (project / "mine.py").write_text("")
    result = run_cli("launcher", "--config", "config.yaml", "--num_gpus_per_node", "2", "--script", "mine.py")
    assert result.exit_code == 0, result.output
    script = project / "scripts" / "run_training.sh"
    assert f"WORKDIR={project}" in script.read_text()
    fake = fake_tools(tmp_path, "torchrun")
    (fake / "torchrun").write_text('#!/bin/bash\nfor a in "$@"; do [[ -e "$a" ]] && echo "found $a"; done; true\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = run_script(script, tmp_path, "torchrun", cwd=elsewhere)
    assert run.stdout.splitlines() == ["found mine.py", "found config.yaml", "found config/ds_config.json"], (
        run.stdout + run.stderr
    )


def test_workdir_keeps_the_shells_spelling_of_this_folder(run_cli, tmp_path, monkeypatch):
    """$PWD (symbolic links kept, as users see the folder) when it is this folder, else the resolved one."""
    from distsetup.cli.launch_spec import working_folder

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.chdir(tmp_path / "link")
    monkeypatch.setenv("PWD", str(tmp_path / "link"))
    assert working_folder() == str(tmp_path / "link")
    monkeypatch.setenv("PWD", str(tmp_path))  # stale: another folder
    assert working_folder() == os.path.realpath(tmp_path / "real")


@pytest.mark.parametrize(
    "args", [["--module", "pkg.train"], ["--python_module", "pkg.train"], ["--python-module", "pkg.train"]]
)
def test_python_module_flag_and_its_old_spelling(run_cli, project, args):
    """--python_module names the Python module here as in `slurm` (where --module meant an environment module);
    --module keeps working for one release, with a one-line warning."""
    result = run_cli("launcher", *args, "--num_gpus_per_node", "2", "-o", "run.sh")
    assert result.exit_code == 0, result.output
    text = (project / "run.sh").read_text()
    header = text.splitlines()[2]
    assert "MODULE=pkg.train" in text and "--python_module pkg.train" in header and "--module" not in header
    warnings = [line for line in result.stderr.splitlines() if "deprecated" in line]
    if args[0] == "--module":
        assert warnings == [
            "Warning: `launcher --module` is deprecated and goes in the next release: use "
            "--python_module (same meaning)."
        ]
    else:
        assert warnings == []
    both = run_cli("launcher", "--module", "a", "--python_module", "b", "-o", "-")
    assert both.exit_code != 0 and "give one of them" in both.output


def test_help_names_the_new_flags(run_cli):
    text = run_cli("launcher", "--help").stdout
    assert "--python_module" in text and "--module " not in text and "distsetup.train" in text


def test_the_run_config_init_writes_is_found_for_the_trainer_not_for_your_own_program(run_cli, tmp_path, monkeypatch):
    """Without --config the trainer would run on its built-in defaults beside the config `distsetup init` wrote (the
    "Next:" line of `distsetup deepspeed` names no --config): config/config.yaml is used, as config/ds_config.json."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text("training:\n  max_steps: 2\n")
    for command in ("launcher", "slurm"):
        result = run_cli(command, "--num_gpus_per_node", 2, "-o", f"{command}.sh")
        assert result.exit_code == 0, result.output
        assert "Note: using config/config.yaml for the trainer (none given with --config)." in result.stderr
        assert "TRAIN_ARGS=(--config config/config.yaml" in (tmp_path / f"{command}.sh").read_text()
    result = run_cli("launcher", "--python_module", "distsetup.train", "--num_gpus_per_node", 2, "-o", "named.sh")
    assert "TRAIN_ARGS=(--config config/config.yaml" in (tmp_path / "named.sh").read_text()  # the trainer, named
    result = run_cli("launcher", "--script", "mine.py", "--num_gpus_per_node", 2, "-o", "own.sh")
    assert result.exit_code == 0, result.output
    assert "config/config.yaml" not in result.stderr + (tmp_path / "own.sh").read_text()
    (tmp_path / "config" / "config.yaml").write_text("training:\n  max_step: 2\n")
    doctor = run_cli("doctor")
    assert doctor.exit_code == 1 and "PROBLEM config/config.yaml: training.max_step: unknown key" in doctor.output


def test_a_timeout_for_a_users_own_program_is_said_to_be_its_own_to_set(run_cli, tmp_path, monkeypatch):
    """--timeout_minutes goes to distsetup's trainer alone; for a --script it was dropped without a word."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text("")
    own = run_cli("launcher", "--script", "mine.py", "--timeout_minutes", 5, "-o", "own.sh")
    assert own.exit_code == 0 and "--timeout_minutes is distsetup's trainer's collective timeout" in own.stderr
    assert "#   bash own.sh --your_flag value" in (tmp_path / "own.sh").read_text()  # not the trainer's overrides
    ours = run_cli("launcher", "--timeout_minutes", 5, "-o", "ours.sh")
    assert "distributed.timeout_minutes=5" in (tmp_path / "ours.sh").read_text() and "--timeout_minutes is" not in (
        ours.stderr
    )
    assert "#   bash ours.sh training.max_steps=100" in (tmp_path / "ours.sh").read_text()
