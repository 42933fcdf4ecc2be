"""Each program that reads a file distsetup writes, asked what it understood: Accelerate (its launcher's flags
and environment, and the FullyShardedDataParallelPlugin its processes build from them) and the HF Trainer
(TrainingArguments' FSDP plugin arguments). On CPU, where neither runs FSDP, through the objects they build.
DeepSpeed's own readers (DeepSpeedConfig, zero_to_fp32) are asked in unit/test_deepspeed_config.py and
processes/test_train_export.py; the HF Trainer's own ZeRO-3 run is processes/test_hf_trainer_saves_zero3_weights.py."""

import json
import os
from unittest import mock

import pytest
from shell_checks import run_script

from distsetup.formats.fsdp import FsdpSpec, accelerate_launch_args
from distsetup.formats.fsdp_rules import fsdp_findings, fsdp_problems

accelerate_launch = pytest.importorskip("accelerate.commands.launch")
transformers = pytest.importorskip("transformers")

FSDP_FLAGS = {
    "fsdp2-shard-grad-op-offload-bf16": [
        "--sharding_strategy",
        "SHARD_GRAD_OP",
        "--cpu_offload",
        "--mixed_precision",
        "BFLOAT16",
        "--transformer_layer_cls_to_wrap",
        "LlamaDecoderLayer",
    ],
    "fsdp2-size-based-full-state": [
        "--auto_wrap_policy",
        "SIZE_BASED_WRAP",
        "--min_num_params",
        "1000",
        "--state_dict_type",
        "FULL_STATE_DICT",
        "--activation_checkpointing",
    ],
    "fsdp1-shard-grad-op": [
        "--fsdp_version",
        "1",
        "--sharding_strategy",
        "SHARD_GRAD_OP",
        "--transformer_layer_cls_to_wrap",
        "LlamaDecoderLayer",
    ],
}


def accelerate_environment(argv: list[str]) -> dict:
    """The environment `accelerate launch ARGV` gives its processes, as its launch_command prepares it on a GPU
    machine (on CPU it would take its CPU launcher instead)."""
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args, defaults, _ = accelerate_launch._validate_launch_command(
        accelerate_launch.launch_command_parser().parse_args(argv)
    )
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config if defaults else [])
        return prepare_deepspeed_cmd_env(args)[1]
    return prepare_multi_gpu_env(args)


def built_in(env: dict, plugin_class):
    """The plugin an Accelerate process builds from `env`."""
    with mock.patch.dict(os.environ, env, clear=True):
        return plugin_class()


def write_fsdp_file(run_cli, folder, flags) -> tuple[dict, FsdpSpec]:
    result = run_cli("fsdp", *flags, "-o", folder / "fsdp.json")
    assert result.exit_code == 0, result.output
    config = json.loads((folder / "fsdp.json").read_text())
    return config, FsdpSpec.from_dict(config)


@pytest.mark.parametrize("flags", FSDP_FLAGS.values(), ids=FSDP_FLAGS)
def test_accelerate_reads_the_fsdp_file_the_launcher_passes_as_meant(run_cli, tmp_path, monkeypatch, flags):
    """`--launch_method accelerate --use_fsdp --script user.py` passes every FSDP setting on (not plain DDP)."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy, ShardingStrategy, StateDictType

    monkeypatch.chdir(tmp_path)
    _, meant = write_fsdp_file(run_cli, tmp_path, flags)
    (tmp_path / "user.py").write_text("print('a user program')\n")
    result = run_cli(
        "launcher",
        *("--launch_method", "accelerate", "--use_fsdp", "--fsdp_config", "fsdp.json", "--script", "user.py"),
        *("--num_gpus_per_node", "2", "-o", "run.sh"),
    )
    assert result.exit_code == 0, result.output
    argv = run_script(tmp_path / "run.sh", tmp_path, "accelerate", cwd=tmp_path).stdout.splitlines()
    assert argv[0] == "launch" and argv[-1] == "user.py"

    env = accelerate_environment(argv[1:])
    assert env["ACCELERATE_USE_FSDP"] == "true"
    assert env["ACCELERATE_MIXED_PRECISION"] == meant.precision.replace("fp32", "no")
    plugin = built_in(env, FullyShardedDataParallelPlugin)
    assert plugin.fsdp_version == meant.fsdp_version
    assert plugin.state_dict_type == StateDictType[meant.state_dict_type]
    assert plugin.activation_checkpointing == meant.activation_checkpointing
    if meant.fsdp_version == 2:
        assert plugin.reshard_after_forward == meant.reshards_after_forward
        assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) == meant.cpu_offload
    else:
        assert plugin.sharding_strategy == ShardingStrategy[meant.sharding_strategy]
        assert plugin.cpu_offload.offload_params == meant.cpu_offload
    if meant.auto_wrap_policy == "SIZE_BASED_WRAP":
        assert plugin.min_num_params == meant.min_num_params
    else:
        assert plugin.transformer_cls_names_to_wrap == list(meant.transformer_layer_cls_to_wrap)


def test_accelerate_reads_an_fsdp_file_written_for_the_hf_trainer_as_the_hf_trainer_reads_it(run_cli, tmp_path):
    """A TrainingArguments fsdp_config (keys without fsdp_, the classes as a list, cpu_offload) handed to the
    launcher for accelerate: its flags were the file's raw keys (dropped) and str() of the list (a class named
    "['LlamaDecoderLayer'", which wrapping then could not find)."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy, ShardingStrategy

    hf_trainer_file = {
        "version": 2,
        "reshard_after_forward": False,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer", "LlamaRMSNorm"],
        "cpu_offload": True,
        "activation_checkpointing": True,
    }
    (tmp_path / "fsdp.json").write_text(json.dumps(hf_trainer_file))
    (tmp_path / "user.py").write_text("print('a user program')\n")
    result = run_cli(
        "launcher",
        *("--launch_method", "accelerate", "--use_fsdp", "--fsdp_config", tmp_path / "fsdp.json"),
        *("--script", tmp_path / "user.py", "--num_gpus_per_node", "2", "-o", tmp_path / "run.sh"),
    )
    assert result.exit_code == 0, result.output
    argv = run_script(tmp_path / "run.sh", tmp_path, "accelerate", cwd=tmp_path).stdout.splitlines()
    plugin = built_in(accelerate_environment(argv[1:]), FullyShardedDataParallelPlugin)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is False and plugin.activation_checkpointing
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer", "LlamaRMSNorm"]
    # FSDP1 as the HF Trainer spells it: the strategy in reshard_after_forward, which accelerate launch's default
    # strategy (FULL_SHARD) would outrank
    fsdp1 = {"version": 1, "reshard_after_forward": "SHARD_GRAD_OP", "auto_wrap_policy": "NO_WRAP"}
    (tmp_path / "fsdp.json").write_text(json.dumps(fsdp1))
    result = run_cli(
        "launcher",
        *("--launch_method", "accelerate", "--use_fsdp", "--fsdp_config", tmp_path / "fsdp.json"),
        *("--script", tmp_path / "user.py", "--num_gpus_per_node", "2", "-o", tmp_path / "run.sh"),
    )
    assert result.exit_code == 0, result.output
    argv = run_script(tmp_path / "run.sh", tmp_path, "accelerate", cwd=tmp_path).stdout.splitlines()
    device_free = {"FSDP_SYNC_MODULE_STATES": "false", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false"}
    env = {**accelerate_environment(argv[1:]), **device_free}
    plugin = built_in(env, FullyShardedDataParallelPlugin)
    assert plugin.sharding_strategy == ShardingStrategy.SHARD_GRAD_OP


def test_accelerate_reads_the_fsdp_file_inside_its_own_config_yaml_as_meant(run_cli, tmp_path):
    """A user who pastes the file into an Accelerate config YAML (`fsdp_config:`) gets the same meaning; the
    precision goes at the YAML's top level, where Accelerate reads it."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    config, meant = write_fsdp_file(run_cli, tmp_path, FSDP_FLAGS["fsdp2-shard-grad-op-offload-bf16"])
    accelerate_config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "mixed_precision": config["mixed_precision"],
        "fsdp_config": config,
        "num_machines": 1,
        "num_processes": 2,
        "machine_rank": 0,
    }
    (tmp_path / "accelerate.yaml").write_text(json.dumps(accelerate_config))  # JSON is YAML
    env = accelerate_environment(["--config_file", str(tmp_path / "accelerate.yaml"), "user.py"])
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    plugin = built_in(env, FullyShardedDataParallelPlugin)
    assert plugin.reshard_after_forward == meant.reshards_after_forward is False
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]


def test_accelerate_reads_the_deepspeed_file_the_launcher_passes_as_meant(run_cli, tmp_path, monkeypatch):
    """The DeepSpeed file reaches Accelerate's DeepSpeedPlugin whole, from any folder the script starts in."""
    from accelerate.utils import DeepSpeedPlugin

    monkeypatch.chdir(tmp_path)
    flags = ["--zero_stage", "2", "--offload_optimizer", "cpu", "--hf_auto", "-o", "ds.json"]
    assert run_cli("deepspeed", *flags).exit_code == 0
    (tmp_path / "user.py").write_text("print('a user program')\n")
    result = run_cli(
        "launcher",
        *("--launch_method", "accelerate", "--use_deepspeed", "--deepspeed_config", "ds.json", "--script", "user.py"),
        *("--num_gpus_per_node", "2", "-o", "run.sh"),
    )
    assert result.exit_code == 0, result.output
    argv = run_script(tmp_path / "run.sh", tmp_path, "accelerate", cwd=tmp_path).stdout.splitlines()
    env = accelerate_environment(argv[1:])
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    plugin = built_in(env, DeepSpeedPlugin)
    written = json.loads((tmp_path / "ds.json").read_text())
    understood = dict(plugin.deepspeed_config)
    assert understood.pop("steps_per_print") == float("inf")  # Accelerate silences DeepSpeed's log (README)
    assert understood == {key: value for key, value in written.items() if key != "steps_per_print"}
    assert plugin.zero_stage == 2 and plugin.offload_optimizer_device == "cpu"


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "deepspeed"])
def test_accelerate_launch_of_the_trainer_defaults_nothing_it_would_warn_of(
    run_cli, tmp_path, monkeypatch, caplog, backend
):
    """Without an accelerate config file, every launch of distsetup's trainer warned "The following values were
    not passed to `accelerate launch` and had defaults used instead" (its precision and torch.compile, which the
    trainer takes from the run config): the script says them."""
    import accelerate.commands.config.config_args

    monkeypatch.chdir(tmp_path)
    for module in (accelerate_launch, accelerate.commands.config.config_args):  # no `accelerate config` file
        monkeypatch.setattr(module, "default_config_file", str(tmp_path / "none.yaml"))
    files = {"ddp": [], "fsdp": ["--use_fsdp"], "deepspeed": ["--use_deepspeed", "--deepspeed_config", "ds.json"]}
    assert run_cli("deepspeed", "--zero_stage", "2", "-o", "ds.json").exit_code == 0
    written = run_cli(
        "launcher", "--launch_method", "accelerate", *files[backend], "--num_gpus_per_node", 2, "-o", "r.sh"
    )
    assert written.exit_code == 0, written.output
    argv = run_script(tmp_path / "r.sh", tmp_path, "accelerate", cwd=tmp_path).stdout.splitlines()
    with caplog.at_level("WARNING", logger=accelerate_launch.__name__):
        args, defaults, _ = accelerate_launch._validate_launch_command(
            accelerate_launch.launch_command_parser().parse_args(argv[1:])
        )
    assert defaults is None and (args.mixed_precision, args.dynamo_backend) == ("no", "no")
    assert [r.getMessage() for r in caplog.records if "had defaults used instead" in r.getMessage()] == []


@pytest.mark.parametrize("flags", FSDP_FLAGS.values(), ids=FSDP_FLAGS)
def test_the_hf_trainer_reads_the_fsdp_file_as_meant(run_cli, tmp_path, monkeypatch, flags):
    """The Trainer reads cpu_offload (not offload_params) and, for FSDP1, the sharding strategy from
    reshard_after_forward: the file gives both, so an offloading file trains offloaded and a SHARD_GRAD_OP file as
    SHARD_GRAD_OP. A script of the user's gets it as the Trainer's arguments take it, `--fsdp --fsdp_config FILE`
    (under torchrun it got nothing, and trained DDP)."""
    monkeypatch.chdir(tmp_path)
    _, meant = write_fsdp_file(run_cli, tmp_path, flags)
    (tmp_path / "user.py").write_text("print('a user program')\n")
    result = run_cli(
        "launcher", "--use_fsdp", "--fsdp_config", "fsdp.json", "--script", "user.py", "--num_gpus_per_node", 2,
        "-o", "run.sh",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    ran = run_script(tmp_path / "run.sh", tmp_path, "torchrun", cwd=tmp_path)
    argv = ran.stdout.splitlines()
    given = argv[argv.index("user.py") + 1 :]
    # on a machine without GPUs only, as the accelerate script says of its own
    warned = "the HF Trainer (through Accelerate) applies FSDP to GPU processes only" in ran.stderr
    assert warned == ("no GPUs found" in ran.stderr)
    assert given == ["--fsdp", "--fsdp_config", "fsdp.json"]
    parser = transformers.HfArgumentParser(transformers.TrainingArguments)
    (arguments,) = parser.parse_args_into_dataclasses(args=[*given, "--output_dir", "out", "--report_to", "none"])
    understood = arguments.fsdp_plugin_args
    assert understood["fsdp_version"] == meant.fsdp_version
    assert understood.get("cpu_offload", False) == meant.cpu_offload
    assert understood["auto_wrap_policy"] == meant.auto_wrap_policy
    assert understood["state_dict_type"] == meant.state_dict_type
    assert understood.get("activation_checkpointing", False) == meant.activation_checkpointing
    if meant.fsdp_version == 2:
        assert understood["reshard_after_forward"] == meant.reshards_after_forward
    else:  # the strategy's name, in any case (Accelerate upper-cases it)
        assert understood["reshard_after_forward"].upper() == meant.sharding_strategy
    if meant.auto_wrap_policy == "SIZE_BASED_WRAP":
        assert understood["min_num_params"] == meant.min_num_params
    else:
        assert understood["transformer_cls_names_to_wrap"] == ",".join(meant.transformer_layer_cls_to_wrap)


def test_validate_knows_the_trainers_key_names_and_refuses_what_readers_would_read_apart():
    """`validate` knows the Trainer's own key names (fsdp_cpu_offload is no unknown key)."""
    base = {"fsdp_version": 2, "fsdp_sharding_strategy": "FULL_SHARD", "fsdp_auto_wrap_policy": "NO_WRAP"}
    assert fsdp_problems({**base, "fsdp_cpu_offload": True}) == []
    assert FsdpSpec.from_dict({**base, "fsdp_cpu_offload": True}).cpu_offload
    apart = {**base, "fsdp_cpu_offload": True, "fsdp_offload_params": False}
    assert [p.path for p in fsdp_problems(apart)] == ["fsdp_cpu_offload"]
    strategy_in_fsdp2 = {**base, "fsdp_reshard_after_forward": "SHARD_GRAD_OP"}
    assert [p.path for p in fsdp_problems(strategy_in_fsdp2)] == ["fsdp_reshard_after_forward"]
    fsdp1 = {**base, "fsdp_version": 1, "fsdp_sharding_strategy": "SHARD_GRAD_OP"}
    assert fsdp_problems({**fsdp1, "fsdp_reshard_after_forward": "SHARD_GRAD_OP"}) == []
    assert FsdpSpec.from_dict({**fsdp1, "fsdp_reshard_after_forward": "SHARD_GRAD_OP"}).sharding_strategy == (
        "SHARD_GRAD_OP"
    )
    assert [p.path for p in fsdp_problems({**fsdp1, "fsdp_reshard_after_forward": "FULL_SHARD"})] == [
        "fsdp_reshard_after_forward"
    ]
    # FSDP2 under Accelerate and the HF Trainer reshards unless told not to: a strategy alone that says otherwise
    # trains FULL_SHARD there, SHARD_GRAD_OP in distsetup's trainer
    strategy_alone = {**base, "fsdp_sharding_strategy": "SHARD_GRAD_OP"}
    assert [p.path for p in fsdp_findings(strategy_alone, hf_trainer=True)[0]] == ["fsdp_sharding_strategy"]
    assert fsdp_findings({**strategy_alone, "fsdp_reshard_after_forward": False}, hf_trainer=True)[0] == []
    assert fsdp_problems(strategy_alone) == []  # for distsetup's trainer, or accelerate launch (the launcher's flags)
    assert accelerate_launch_args(strategy_alone)[-2:] == ["--fsdp_reshard_after_forward", "false"]


def test_transformer_based_wrap_without_classes_wraps_the_models_own_blocks_as_accelerate_does(run_cli, tmp_path):
    """As `accelerate config` writes it where the user takes the model's _no_split_modules: Accelerate's plugin wraps
    those; validate and `distsetup fsdp` say so in a note, and refuse nothing."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import LlamaConfig, LlamaForCausalLM

    no_classes = {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_reshard_after_forward": True,
    }
    problems, notes = fsdp_findings(no_classes)
    assert problems == [] and any("wraps the model's own blocks" in note for note in notes), notes
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}
    plugin = built_in(env, FullyShardedDataParallelPlugin)
    tiny = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=32)
    plugin.set_auto_wrap_policy(LlamaForCausalLM(tiny))
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    written = run_cli("fsdp", "--auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "-o", tmp_path / "fsdp.json")
    assert written.exit_code == 0 and "wraps the model's own blocks" in written.output, written.output
    assert "fsdp_transformer_layer_cls_to_wrap" not in json.loads((tmp_path / "fsdp.json").read_text())


def test_validate_refuses_spellings_accelerate_reads_but_another_reader_stops_on(run_cli, tmp_path):
    """A lower-case wrapping policy in a file: the HF Trainer's TrainingArguments stops on it. A list of classes in
    an Accelerate config YAML: `accelerate launch` hands the plugin "['A', 'B']"."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    lower = {"version": 2, "auto_wrap_policy": "transformer_based_wrap", "transformer_layer_cls_to_wrap": ["A"]}
    with pytest.raises(ValueError, match="auto_wrap_policy` must be one of"):
        TrainingArguments(output_dir=str(tmp_path), use_cpu=True, fsdp="full_shard", fsdp_config=dict(lower))
    (tmp_path / "fsdp.json").write_text(json.dumps(lower))
    refused = run_cli("validate", tmp_path / "fsdp.json", "--hf")
    assert refused.exit_code == 1 and 'Fix: write "TRANSFORMER_BASED_WRAP"' in refused.output, refused.output
    noted = run_cli("validate", tmp_path / "fsdp.json")  # Accelerate's and distsetup's trainer's: said in a note
    assert noted.exit_code == 0 and "the HF Trainer stops on it" in noted.output, noted.output
    for named in ("fsdp.json", lower):  # TrainingArguments naming the file, or with its settings in place
        arguments = {"output_dir": "out", "fsdp": True, "fsdp_config": named}
        (tmp_path / "training_args.json").write_text(json.dumps(arguments))
        refused = run_cli("validate", tmp_path / "training_args.json")
        assert refused.exit_code == 1 and 'Fix: write "TRANSFORMER_BASED_WRAP"' in refused.output, refused.output

    yaml_config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer", "LlamaRMSNorm"],
        },
        "num_machines": 1,
        "num_processes": 2,
        "machine_rank": 0,
    }
    (tmp_path / "accelerate.yaml").write_text(json.dumps(yaml_config))  # JSON is YAML
    env = accelerate_environment(["--config_file", str(tmp_path / "accelerate.yaml"), "user.py"])
    plugin = built_in(env, FullyShardedDataParallelPlugin)
    assert plugin.transformer_cls_names_to_wrap == ["['LlamaDecoderLayer'", " 'LlamaRMSNorm']"]
    refused = run_cli("validate", tmp_path / "accelerate.yaml")
    assert refused.exit_code == 1 and "write 'LlamaDecoderLayer,LlamaRMSNorm'" in refused.output, refused.output


def test_the_hf_trainers_fsdp1_trains_the_files_sharding_strategy_under_torchrun(run_cli, tmp_path, monkeypatch):
    """transformers hands an FSDP1 file's strategy to Accelerate as reshard_after_forward, which Accelerate's own
    FSDP_SHARDING_STRATEGY outranks (FULL_SHARD where unset): the script for a user's program sets it."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import ShardingStrategy
    from transformers import TrainingArguments

    monkeypatch.chdir(tmp_path)
    config, meant = write_fsdp_file(run_cli, tmp_path, FSDP_FLAGS["fsdp1-shard-grad-op"])
    (tmp_path / "user.py").write_text("print('a user program')\n")
    result = run_cli(
        "launcher", "--script", "user.py", "--use_fsdp", "--fsdp_config", "fsdp.json", "--num_gpus_per_node", "2",
        "-o", "run.sh",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    shown = run_script(tmp_path / "run.sh", tmp_path, "torchrun", show_env=["FSDP_SHARDING_STRATEGY"], cwd=tmp_path)
    env = dict(line.split("=", 1) for line in shown.stdout.splitlines() if line.startswith("FSDP_"))
    assert env == {"FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"}
    hf_args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, fsdp=True, fsdp_config=config)
    for given, strategy in (({}, ShardingStrategy.FULL_SHARD), (env, ShardingStrategy[meant.sharding_strategy])):
        with mock.patch.dict(os.environ, given, clear=True):  # a device-free plugin: no sync_module_states
            plugin = FullyShardedDataParallelPlugin(**{**hf_args.fsdp_plugin_args, "sync_module_states": False})
        assert plugin.sharding_strategy == strategy


def test_validate_says_who_reads_the_keys_not_every_reader_reads(run_cli, tmp_path):
    flags = FSDP_FLAGS["fsdp2-shard-grad-op-offload-bf16"]
    write_fsdp_file(run_cli, tmp_path, flags)
    result = run_cli("validate", tmp_path / "fsdp.json")
    assert result.exit_code == 0, result.output
    notes = {line.split(": note: ")[1].split(":")[0]: line for line in result.stdout.splitlines() if ": note: " in line}
    assert set(notes) == {
        "fsdp_offload_params",
        "fsdp_cpu_offload",
        "fsdp_sharding_strategy",
        "mixed_precision",
        "fsdp_reduce_dtype",
    }
    assert "the HF Trainer reads fsdp_cpu_offload" in notes["fsdp_offload_params"]
    assert "distsetup's trainer only" in notes["mixed_precision"]


HF_SPELLED = {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "state_dict_type": "FULL_STATE_DICT"}


@pytest.mark.parametrize(
    "settings, noted, built",
    [
        ({}, None, {"fsdp_version": 2}),  # no version: FSDP2 to the HF Trainer (required where the reader is unknown)
        ({"version": 2, "offload_params": True}, "fsdp_offload_params", {"cpu_offload": None}),
        (
            {"version": 1, "sharding_strategy": "SHARD_GRAD_OP"},
            "fsdp_sharding_strategy",
            {"reshard_after_forward": "full_shard"},
        ),
    ],
    ids=["no version", "accelerate's offload key", "fsdp1 strategy alone"],
)
def test_validate_for_the_hf_trainer_says_what_transformers_builds_of_the_file(tmp_path, settings, noted, built):
    """What TrainingArguments builds of an fsdp_config in its own spelling: a file without a version is FSDP2 there;
    offload_params alone offloads nothing (it reads cpu_offload), and FSDP1's strategy alone is FULL_SHARD (it reads
    reshard_after_forward). validate --hf refused the first and passed the others without a word; they are notes,
    since TrainingArguments' fsdp words (offload, shard_grad_op), which the file does not show, may say them."""
    from distsetup.formats.validate import validate_file

    config = {**HF_SPELLED, **settings}
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(config))
    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, fsdp=True, fsdp_config=str(path))
    assert {key: hf_args.fsdp_plugin_args.get(key) for key in built} == built
    validated = validate_file(path, "fsdp", hf=True)
    assert validated.problems == []
    said = [note.split(":")[0] for note in validated.notes]
    assert [key for key in said if key in ("fsdp_offload_params", "fsdp_sharding_strategy")] == (
        [noted] if noted else []
    )
    if not settings:  # for a reader not known, the version is asked for: accelerate launch's own default is FSDP1
        (problem,) = validate_file(path, "fsdp").problems
        assert problem.path == "fsdp_version" and "depends on who reads it" in problem.message


def test_training_arguments_saved_by_transformers_itself_pass_validate(tmp_path):
    """TrainingArguments.to_json_string() writes XLA's switches off and min_num_params 0 into its fsdp_config: they
    were unknown keys and a value out of range."""
    from distsetup.formats.validate import validate_file

    fsdp = tmp_path / "fsdp.json"
    fsdp.write_text(json.dumps({"fsdp_version": 2, "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}))
    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, fsdp=True, fsdp_config=str(fsdp))
    saved = tmp_path / "training_args.json"
    saved.write_text(hf_args.to_json_string())
    assert {"xla", "min_num_params"} <= set(json.loads(saved.read_text())["fsdp_config"])
    validated = validate_file(saved)
    assert validated.kind == "training_args" and validated.problems == []


def test_validate_for_the_hf_trainer_notes_what_accelerate_fills_its_own_autos_with(tmp_path):
    """ "auto" in the offload device or the 16-bit save is Accelerate's own setting, not the Trainer's: without
    accelerate launch's flag, nothing is offloaded and save_model writes no weights at ZeRO-3 (validate --hf passed
    them without a word)."""
    from accelerate.utils import DeepSpeedPlugin

    from distsetup.formats.validate import validate_file

    zero = {"stage": 3, "offload_optimizer": {"device": "auto"}, "stage3_gather_16bit_weights_on_model_save": "auto"}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": zero}))
    validated = validate_file(path, "deepspeed", hf=True)
    assert validated.problems == []
    notes = {note.split(":")[0]: note for note in validated.notes}
    with mock.patch.dict(os.environ, {"PATH": os.environ["PATH"]}, clear=True):
        filled = DeepSpeedPlugin(hf_ds_config=str(path)).hf_ds_config.config["zero_optimization"]
    assert filled["offload_optimizer"]["device"] == "none"
    assert "none without one" in notes["zero_optimization.offload_optimizer.device"]
    assert filled["stage3_gather_16bit_weights_on_model_save"] is False
    assert "false without one" in notes["zero_optimization.stage3_gather_16bit_weights_on_model_save"]


def test_validate_says_what_accelerate_launch_ignores_in_its_config_yamls_fsdp_block(tmp_path):
    """An FSDP block in the HF Trainer's spelling, with a precision of its own: accelerate launch reads each key as
    fsdp_<key>, so it offloads nothing (cpu_offload is the Trainer's), trains in the config's own precision, and,
    with no policy, wraps nothing; validate said "no problems"."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    from distsetup.formats.validate import validate_file

    block = {"version": 2, "cpu_offload": True, "transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}
    block |= {"reshard_after_forward": False, "mixed_precision": "bf16"}
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "mixed_precision": "no"}
    config |= {"num_machines": 1, "num_processes": 2, "machine_rank": 0, "fsdp_config": block}
    path = tmp_path / "accelerate.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    found = [p.path for p in validate_file(path).problems]
    assert found == ["fsdp_config.cpu_offload", "fsdp_config.mixed_precision", "fsdp_config.fsdp_auto_wrap_policy"]
    env = accelerate_environment(["--config_file", str(path), "user.py"])
    plugin = built_in(env, FullyShardedDataParallelPlugin)
    assert env["ACCELERATE_MIXED_PRECISION"] == "no" and plugin.mixed_precision_policy is None
    assert not isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    assert plugin.auto_wrap_policy is None
