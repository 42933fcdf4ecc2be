"""`distsetup validate` on the files users bring from elsewhere: Accelerate config YAMLs written by hand with
the classic mistakes, TrainingArguments beside a DeepSpeed file and their values of the wrong type, and what
`--resolve` needs. (Against Accelerate and transformers themselves:
tests/processes/test_validate_against_clients.py.)"""

import json
import os
from pathlib import Path

import pytest
import yaml
from brought_files import BASE_DS, write
from repo import REPO


def problem_paths(run_cli, path: Path, *args) -> list[str]:
    result = run_cli("validate", path, "--json", *args)
    assert result.exit_code in (0, 1), result.output
    return [p["path"] for p in json.loads(result.stdout)]


MULTI_NODE = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "MULTI_GPU",
    "mixed_precision": "bf16",
    "num_machines": 2,
    "machine_rank": 0,
    "num_processes": 16,
    "main_process_ip": "10.0.0.1",
    "main_process_port": 29500,
}


@pytest.mark.parametrize(
    ("change", "path", "words"),
    [
        ({"num_processes": 8}, "num_processes", "not 2 machine(s) x 8 GPUs = 16 (it counts processes over all"),
        ({"num_processes": "16"}, "num_processes", "write num_processes: 16 without quotes"),
        ({"machine_rank": 2}, "machine_rank", "is not a rank of 2 machine(s)"),
        ({"main_process_ip": None}, "main_process_ip", "the other machines cannot find the main one"),
        ({"distributed_type": "MULTI_GPUS"}, "distributed_type", "did you mean 'MULTI_GPU'?"),
        ({"distributed_type": "multi_gpu"}, "distributed_type", "did you mean 'MULTI_GPU'?"),  # in any case
        (  # its fsdp_config is not said to be ignored besides: the kind is unknown, not another
            {"distributed_type": "fsdp", "fsdp_config": {"fsdp_version": 2}},
            "distributed_type",
            "did you mean 'FSDP'?",
        ),
        ({"distributed_type": "GPU_CLUSTER"}, "distributed_type", "valid values: DEEPSPEED"),
        ({"num_process": 16}, "num_process", "did you mean 'num_processes'?"),
        ({"mixed_precision": "bfloat16"}, "mixed_precision", "use no, fp16, bf16 or fp8"),
        (
            {"fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}},
            "fsdp_config",
            "is ignored: distributed_type is MULTI_GPU",
        ),
        (
            {"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARDS"}},
            "fsdp_config.fsdp_sharding_strategy",
            "",
        ),
        (
            {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 2, "offload_param_device": "cpu"}},
            "deepspeed_config.offload_param_device",
            "DeepSpeed uses it at stage 3 only",
        ),
        (
            {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 0, "offload_optimizer_device": "cpu"}},
            "deepspeed_config.offload_optimizer_device",
            "DeepSpeed uses it at stages 1, 2, 3 only",
        ),
        (
            {
                "distributed_type": "DEEPSPEED",
                "deepspeed_config": {"zero_stage": 3, "offload_optimizer_device": "nvme"},
            },
            "deepspeed_config.offload_optimizer_nvme_path",
            "add deepspeed_config.offload_optimizer_nvme_path",
        ),
        (
            {
                "distributed_type": "DEEPSPEED",
                "deepspeed_config": {"deepspeed_config_file": "ds.json", "zero_stage": 2},
                "mixed_precision": None,
            },
            "deepspeed_config.zero_stage",
            "set it in the DeepSpeed file and remove it here",
        ),
        (
            {"distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_config_file": "ds.json"}},
            "mixed_precision",  # the top-level one, beside a DeepSpeed file
            "set it in the DeepSpeed file",
        ),
        (
            {
                "distributed_type": "DEEPSPEED",
                "deepspeed_config": {"deepspeed_config_file": "bad_ds.json"},
                "mixed_precision": None,
            },
            "deepspeed_config.deepspeed_config_file -> bf16.enabled",
            "fp16 and bf16 are both enabled",
        ),
        (  # `accelerate config` for CPUs without mpirun: accelerate launch would start 1 process, not 16
            {"distributed_type": "MULTI_CPU", "use_cpu": True, "mpirun_config": {}},
            "mpirun_config",
            "`accelerate launch` starts 1 process, not num_processes 16",
        ),
        # an older `accelerate config` wrote it (MULTI_CPU); its near spelling, fp8_config, is no fix
        ({"ipex_config": {"ipex": False}}, "ipex_config", "remove it: an older `accelerate config` wrote it"),
    ],
)
def test_classic_accelerate_mistakes_are_named_with_their_key_and_fix(run_cli, tmp_path, change, path, words):
    write(tmp_path / "ds.json", {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}})
    write(
        tmp_path / "bad_ds.json",
        {
            "train_micro_batch_size_per_gpu": 1,
            "bf16": {"enabled": True},
            "fp16": {"enabled": True},
            "zero_optimization": {"stage": 2},  # Accelerate refuses a file without it
        },
    )
    config = {key: value for key, value in {**MULTI_NODE, **change}.items() if value is not None}
    file = write(tmp_path / "accelerate.yaml", config)
    result = run_cli("validate", file, "--num_gpus_per_node", 8)
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stdout.splitlines() if f": {path}: " in line]
    assert len(lines) == 1 and words in lines[0], result.stdout
    assert problem_paths(run_cli, file, "--num_gpus_per_node", 8) == [path]  # that mistake alone


def test_the_correct_multi_node_file_passes_and_the_default_path_gets_a_note(run_cli, tmp_path, monkeypatch):
    assert problem_paths(run_cli, write(tmp_path / "a.yaml", MULTI_NODE), "--num_gpus_per_node", 8) == []
    mpirun = {**MULTI_NODE, "distributed_type": "MULTI_CPU", "mpirun_config": {"mpirun_hostfile": "hosts"}}
    assert problem_paths(run_cli, write(tmp_path / "cpu.yaml", mpirun), "--num_gpus_per_node", 8) == []
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    note = "note: this is Accelerate's default config: `accelerate launch` without --config_file uses it"
    default = tmp_path / ".cache" / "huggingface" / "accelerate" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    write(default, MULTI_NODE)
    result = run_cli("validate", default)
    assert result.exit_code == 0
    assert note in result.stdout
    # accelerate looks in $HF_HOME first (its config_args.py): the file there is the default one, not that in ~/.cache
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert note not in run_cli("validate", default).stdout
    moved = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    moved.parent.mkdir(parents=True)
    write(moved, MULTI_NODE)
    assert note in run_cli("validate", moved).stdout


def test_training_arguments_of_the_wrong_type_are_named(run_cli, tmp_path):
    file = write(tmp_path / "args.yaml", {"output_dir": "out", "per_device_train_batch_size": "8", "bf16": "true"})
    result = run_cli("validate", file)
    assert result.exit_code == 1
    assert problem_paths(run_cli, file) == ["per_device_train_batch_size", "bf16"]
    assert "write per_device_train_batch_size: 8 without quotes" in result.stdout


def test_resolve_says_what_it_needs(run_cli, tmp_path):
    ds_file = tmp_path / "ds_hf.json"
    assert run_cli("deepspeed", "--zero_stage", 3, "--hf_auto", "-o", ds_file).exit_code == 0
    shown = run_cli("validate", ds_file, "--hf", "--resolve", "--micro_batch_size", 4)
    assert "resolve: train_micro_batch_size_per_gpu = 4 (per_device_train_batch_size)" in shown.stdout
    assert "resolve: train_batch_size = ? (give --world_size)" in shown.stdout
    assert "resolve: zero_optimization.reduce_bucket_size = ? (give --hidden_size)" in shown.stdout
    not_deepspeed = run_cli(
        "validate", write(tmp_path / "f.json", {"fsdp_sharding_strategy": "FULL_SHARD"}), "--resolve"
    )
    assert not_deepspeed.exit_code == 1 and "--resolve needs a DeepSpeed file" in not_deepspeed.stderr
    unread = run_cli("validate", ds_file, "--hf", "--hidden_size", 4096)  # it was dropped without a word
    assert unread.exit_code == 1 and "--hidden_size is read only with --resolve" in unread.stderr


def test_validate_of_a_yaml_run_config_is_unchanged(run_cli):
    assert run_cli("validate", REPO / "config" / "config.yaml").exit_code == 0
    assert os.path.exists(REPO / "config" / "config.yaml")


@pytest.mark.parametrize(
    ("change", "paths"),
    [
        ({"num_machines": None, "machine_rank": None, "main_process_ip": None}, ["num_processes"]),
        ({"distributed_type": ["MULTI_GPU"]}, ["distributed_type"]),
        ({"mixed_precision": {"a": 1}}, ["mixed_precision"]),
        ({1: "x"}, ["1"]),
        ({"fsdp_config": ["a"]}, ["fsdp_config"]),
        ({"distributed_type": "DEEPSPEED", "deepspeed_config": "zero3"}, ["deepspeed_config"]),
        ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": True}}, ["deepspeed_config.zero_stage"]),
        ({"num_machines": True}, ["num_machines"]),
    ],
)
def test_odd_accelerate_values_are_problems_not_tracebacks(run_cli, tmp_path, change, paths):
    config = {key: value for key, value in {**MULTI_NODE, **change}.items() if value is not None}
    assert problem_paths(run_cli, write(tmp_path / "odd.yaml", config), "--num_gpus_per_node", 8) == paths


def test_a_zero_stage_written_as_text_is_the_stage_accelerate_reads(run_cli, tmp_path):
    """`accelerate launch` reads zero_stage "3" as 3 (tests/processes/test_validate_against_clients.py): validated as
    that stage, so a stage-3 option beside "1" is still a problem."""
    config = {**MULTI_NODE, "distributed_type": "DEEPSPEED"}
    as_text = write(
        tmp_path / "a.yaml", {**config, "deepspeed_config": {"zero_stage": "3", "offload_param_device": "cpu"}}
    )
    assert problem_paths(run_cli, as_text, "--num_gpus_per_node", 8) == []
    stage_1 = write(
        tmp_path / "b.yaml", {**config, "deepspeed_config": {"zero_stage": "1", "offload_param_device": "cpu"}}
    )
    assert problem_paths(run_cli, stage_1, "--num_gpus_per_node", 8) == ["deepspeed_config.offload_param_device"]


def test_num_processes_against_the_world_size(run_cli, tmp_path):
    file = write(tmp_path / "a.yaml", MULTI_NODE)
    assert problem_paths(run_cli, file, "--world_size", 16) == []
    result = run_cli("validate", file, "--world_size", 8)
    assert "num_processes: 16 is not the world size 8 = 8." in result.stdout


def test_training_arguments_in_yaml_are_read_as_pyyaml_reads_them(run_cli, tmp_path):
    """HfArgumentParser.parse_yaml_file uses yaml.safe_load: `3e-5` is a string there, not a number."""
    file = tmp_path / "args.yaml"
    file.write_text("output_dir: out\nper_device_train_batch_size: 4\nlearning_rate: 3e-5\nwarmup_steps: '0.1'\n")
    result = run_cli("validate", file)
    assert problem_paths(run_cli, file) == ["learning_rate", "warmup_steps"]
    assert "write learning_rate: 3.0e-05 (PyYAML reads 3e-5 as text)." in result.stdout
    assert yaml.safe_load("learning_rate: 3.0e-05")["learning_rate"] == 3e-5  # the fix is a number to PyYAML


def test_values_of_the_wrong_type_are_not_compared_or_resolved(run_cli, tmp_path):
    # BASE_DS differs from TrainingArguments' defaults in several values: none is compared while types are wrong
    write(tmp_path / "ds.json", {**BASE_DS, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})
    file = write(
        tmp_path / "training_args.json",
        {"output_dir": "out", "deepspeed": "ds.json", "max_steps": "100", "gradient_accumulation_steps": "2"},
    )
    assert problem_paths(run_cli, file, "--world_size", 1) == ["gradient_accumulation_steps", "max_steps"]
    resolved = run_cli("validate", file, "--resolve", "--world_size", 1)
    assert resolved.exit_code == 1 and "has values of the wrong type" in resolved.stderr


def test_kind_run_config_reads_yaml_whatever_the_name(run_cli, tmp_path):
    file = tmp_path / "rc.txt"
    file.write_text("training: {max_steps: 5}\n")
    assert run_cli("validate", file, "--kind", "run_config").exit_code == 0


def test_resolve_of_a_deepspeed_file_alone_finds_the_batch_the_trainer_would_stop_on(run_cli, tmp_path):
    """--hf --resolve with the batch given as flags: a train_batch_size that is not world x micro x accumulation
    stops the HF Trainer ("mismatch TrainingArguments"), as a TrainingArguments file naming it is told; values the
    flags do not give (the lr, the clipping) are not compared with TrainingArguments' defaults."""
    file = write(
        tmp_path / "ds.json",
        {
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 2},
        },
    )
    args = ["validate", file, "--hf", "--resolve", "--world_size", 8]
    result = run_cli(*args, "--micro_batch_size", 2)  # 8 x 2 x 1 = 16, not 32
    assert result.exit_code == 1 and "train_batch_size: 32" in result.stdout and "(16)" in result.stdout
    assert "gradient_clipping" not in result.stdout and "lr" not in result.stdout.replace("resolve", "")
    assert run_cli(*args, "--micro_batch_size", 4).exit_code == 0


def test_the_rules_hold_for_what_trainingarguments_put_in_the_files_auto(run_cli, tmp_path):
    """fp16 "auto" at ZeRO stage 0 is fp16 once TrainingArguments(fp16=True) fills it: the run would not learn
    (DeepSpeed 0.19 does not loss-scale it there), as a file that says true is told."""
    stage_0 = {"train_micro_batch_size_per_gpu": "auto", "fp16": {"enabled": "auto"}, "zero_optimization": {"stage": 0}}
    write(tmp_path / "z0.json", stage_0)
    file = write(tmp_path / "args.json", {"output_dir": "o", "per_device_train_batch_size": 2, "deepspeed": "z0.json"})
    assert problem_paths(run_cli, file, "--world_size", 2) == []
    fp16 = write(tmp_path / "fp16.json", {**json.loads(file.read_text()), "fp16": True})
    assert problem_paths(run_cli, fp16, "--world_size", 2) == ["deepspeed -> fp16.enabled"]


def test_auto_find_batch_size_leaves_the_batch_sizes_uncompared_and_refuses_zero3(run_cli, tmp_path):
    """With auto_find_batch_size the Trainer fills the batch sizes without comparing them (transformers'
    trainer_config_process; a 2-process run trained where validate said it stops), and refuses ZeRO-3."""
    ds = {**BASE_DS, "train_batch_size": 8, "gradient_accumulation_steps": 1}  # micro 4: TrainingArguments say 2
    args = {"output_dir": "out", "deepspeed": "ds.json", "per_device_train_batch_size": 2, "max_grad_norm": 1.0}
    args.update(learning_rate=3e-4, adam_beta2=0.95, weight_decay=0.1, bf16=True)
    write(tmp_path / "ds.json", ds)
    compared = problem_paths(run_cli, write(tmp_path / "ta.json", args), "--world_size", 2)
    assert compared == ["deepspeed -> train_micro_batch_size_per_gpu", "deepspeed -> train_batch_size"]
    write(tmp_path / "ds.json", {**ds, "bf16": {"enabled": False}})
    said = run_cli("validate", tmp_path / "ta.json", "--world_size", 2).stdout
    assert "bf16.enabled: false in " in said and "bf16|bf16_full_eval (true)" in said, said  # JSON's spelling
    write(tmp_path / "ds.json", ds)
    found = write(tmp_path / "ta.json", {**args, "auto_find_batch_size": True})
    assert problem_paths(run_cli, found, "--world_size", 2) == []
    write(tmp_path / "ds.json", {**ds, "zero_optimization": {"stage": 3}})
    assert problem_paths(run_cli, found, "--world_size", 2) == ["deepspeed -> zero_optimization.stage"]


def test_a_deepspeed_config_written_in_the_training_arguments_is_checked_as_a_named_one(run_cli, tmp_path):
    """TrainingArguments take the DeepSpeed settings as a mapping too: validate said "no problems" where the HF
    Trainer stops on the mismatch, or DeepSpeed on a rule."""
    inline = {
        **BASE_DS,
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}},
    }
    args = {"output_dir": "out", "deepspeed": inline, "per_device_train_batch_size": 2}
    paths = problem_paths(run_cli, write(tmp_path / "ta.json", args), "--world_size", 2)
    assert "deepspeed -> train_micro_batch_size_per_gpu" in paths  # 4 against TrainingArguments' 2
    assert "deepspeed -> zero_optimization.offload_param" in paths  # parameters offloaded below stage 3
