"""`distsetup validate` against the clients themselves: Accelerate's own config classes and DeepSpeedPlugin,
`accelerate config default`, and transformers' HfTrainerDeepSpeedConfig, for TrainingArguments beside a DeepSpeed
file and for --resolve. Each imports transformers or Accelerate (seconds), which is why they run with the tests
that start processes."""

import json
import re
from types import SimpleNamespace

import pytest
from brought_files import BASE_DS, write

from distsetup.formats.accelerate import DISTRIBUTED_TYPES, IGNORED_BESIDE_FILE, KEYS, MIXED_PRECISIONS
from distsetup.formats.hf_trainer import Context, TrainerValues, mismatch_problems, resolve_auto


def test_what_accelerate_knows_is_what_validate_knows():
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType, PrecisionType

    assert set(ClusterConfig.__dataclass_fields__) == KEYS
    assert {d.value for d in DistributedType} == DISTRIBUTED_TYPES
    assert {p.value for p in PrecisionType} == MIXED_PRECISIONS


@pytest.mark.parametrize("key", [*IGNORED_BESIDE_FILE, "mixed_precision", "zero3_init_flag"])
def test_the_keys_accelerate_refuses_beside_a_deepspeed_file(tmp_path, monkeypatch, key):
    """DeepSpeedPlugin itself, given what `accelerate launch` passes on for a config with this key."""
    from accelerate.utils import DeepSpeedPlugin

    ds = write(tmp_path / "ds.json", {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}})
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", f"deepspeed_config_file,{key}")
    if key == "zero3_init_flag":  # allowed beside the file
        DeepSpeedPlugin(hf_ds_config=str(ds))
        return
    with pytest.raises(ValueError, match="will be ignored"):
        DeepSpeedPlugin(hf_ds_config=str(ds))


@pytest.mark.parametrize("stage", [3, "3", "1", True, "3.0", "three", 4])
def test_the_zero_stage_validate_reads_is_the_one_accelerate_takes(monkeypatch, stage):
    """`accelerate launch` passes an Accelerate config's deepspeed_config.zero_stage on as a string (utils/launch.py),
    which DeepSpeedPlugin reads with int(): a stage there is one here, and what fails there is refused here."""
    from accelerate.utils import DeepSpeedPlugin

    from distsetup.formats.deepspeed import accelerate_zero_stage

    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", str(stage))
    try:
        taken = DeepSpeedPlugin().zero_stage
    except (ValueError, KeyError):
        taken = None
    assert accelerate_zero_stage(stage) == (taken if taken in (0, 1, 2, 3) else None)


def test_accelerate_config_default_passes(run_cli, tmp_path):
    from accelerate.commands.config.default import write_basic_config  # what `accelerate config default` runs

    path = tmp_path / "default_config.yaml"
    write_basic_config(save_location=str(path))
    result = run_cli("validate", path, "--num_gpus_per_node", 1)
    assert result.exit_code == 0, result.output
    assert "Accelerate config, no problems" in result.stdout


def hf_mismatches(ds: dict, args) -> set[str]:
    """What transformers' HfTrainerDeepSpeedConfig reports as mismatched (it raises ValueError listing them)."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    hf = HfTrainerDeepSpeedConfig(json.loads(json.dumps(ds)))
    hf.trainer_config_process(args)
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=64))
    try:
        hf.trainer_config_finalize(args, model, num_training_steps=100)
    except ValueError as e:
        return set(re.findall(r"- ds (\S+)=", str(e)))
    return set()


def training_arguments(tmp_path, **values):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], **values)


BASE_ARGS = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    learning_rate=3e-4,
    adam_beta2=0.95,
    weight_decay=0.1,
    bf16=True,
    max_steps=100,
)


@pytest.mark.parametrize(
    ("ds_change", "args_change"),
    [
        ({}, {}),
        ({"train_micro_batch_size_per_gpu": "4"}, {}),  # the Trainer stops on "4" against 4
        ({"gradient_clipping": 0.5}, {}),
        ({}, {"learning_rate": 1e-4}),
        ({}, {"adam_beta2": 0.999, "bf16": False}),
        ({"train_batch_size": 16}, {"gradient_accumulation_steps": 4}),
    ],
)
def test_training_arguments_beside_a_deepspeed_file_find_what_the_trainer_stops_on(
    run_cli, tmp_path, ds_change, args_change
):
    ds = {**BASE_DS, **ds_change}
    args = {**BASE_ARGS, **args_change}
    write(tmp_path / "ds.json", ds)
    file = write(tmp_path / "training_args.json", {"output_dir": "out", "deepspeed": "ds.json", **args})
    result = run_cli("validate", file, "--world_size", 1, "--json")
    ours = {p["path"].split(" -> ")[1] for p in json.loads(result.stdout) if "TrainingArguments" in p["message"]}
    theirs = hf_mismatches(ds, training_arguments(tmp_path, **args))
    assert ours == theirs
    assert bool(ours) == bool(ds_change or args_change)
    if ds_change.get("train_micro_batch_size_per_gpu") == "4":
        (line,) = [p.message for p in mismatch_problems(ds, TrainerValues(**args), Context(1), "ds.json")]
        said = '"4" in ds.json is a string, TrainingArguments\' per_device_train_batch_size is 4, a number'
        assert said in line  # JSON's spelling of the file's value


@pytest.mark.parametrize("stage", [2, 3])
def test_resolve_gives_what_the_hf_trainer_fills_in(run_cli, tmp_path, stage):
    ds_file = tmp_path / "ds_hf.json"
    written = run_cli("deepspeed", "--zero_stage", stage, "--hf_auto", "--scheduler", "WarmupDecayLR", "-o", ds_file)
    assert written.exit_code == 0, written.output
    ds = json.loads(ds_file.read_text())
    args = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=3e-4, bf16=True)
    args.update(warmup_steps=7, max_steps=100, max_grad_norm=0.5, weight_decay=0.1, adam_epsilon=1e-6)
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    hf = HfTrainerDeepSpeedConfig(json.loads(ds_file.read_text()))
    hf.trainer_config_process(training_arguments(tmp_path, **args))
    hf.trainer_config_finalize(
        training_arguments(tmp_path, **args), SimpleNamespace(config=SimpleNamespace(hidden_size=64)), 100
    )
    resolved = resolve_auto(ds, TrainerValues(**args), Context(world_size=1, hidden_size=64))
    assert resolved, "the --hf_auto file has auto values"
    for r in resolved:
        node = hf.config
        for part in r.path.split("."):
            node = node[part]
        assert node == ("auto" if r.value is None else r.value), r
    args_file = write(tmp_path / "training_args.json", {"output_dir": "out", "deepspeed": ds_file.name, **args})
    shown = run_cli("validate", args_file, "--resolve", "--hidden_size", 64, "--world_size", 1)
    assert shown.exit_code == 0, shown.output
    assert "resolve: train_batch_size = 8 (world size x per_device_train_batch_size" in shown.stdout
    assert "resolve: scheduler.params.warmup_num_steps = 7 (warmup_steps" in shown.stdout


def test_validate_hf_refuses_every_auto_the_hf_trainer_leaves_and_no_other(run_cli, tmp_path, monkeypatch):
    """ "auto" at each key validate takes as filled, and at two no reader fills (one a misspelt key): transformers'
    HfTrainerDeepSpeedConfig, then Accelerate's DeepSpeedPlugin under accelerate launch (whose settings fill the
    stage, offload and 16-bit save), leave exactly those two, and the plugin stops on them."""
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from distsetup.formats.deepspeed_rules import FILLED_BY_THE_HF_TRAINER, auto_paths
    from distsetup.formats.problems import join_path

    ds: dict = {"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupDecayLR"}}
    for path in [*FILLED_BY_THE_HF_TRAINER, "gradient_clippin", "zero_optimization.overlap_comm"]:
        *sections, key = path.split(".")
        node = ds
        for section in sections:
            node = node.setdefault(section, {})
        node[key] = "auto"
    ds["zero_optimization"]["stage"] = (
        3  # "auto" is filled by the plugin, after transformers has sized ZeRO-3's buckets
    )
    args = training_arguments(tmp_path, **BASE_ARGS)
    hf = HfTrainerDeepSpeedConfig(json.loads(json.dumps(ds)))
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=64)), 100)
    launch_settings = {  # what accelerate launch sets from its flags or config for the plugin
        "OFFLOAD_OPTIMIZER_DEVICE": "cpu",
        "OFFLOAD_PARAM_DEVICE": "cpu",
        "OFFLOAD_OPTIMIZER_NVME_PATH": "none",
        "OFFLOAD_PARAM_NVME_PATH": "none",
        "ZERO3_SAVE_16BIT_MODEL": "true",
    }
    for setting, value in launch_settings.items():
        monkeypatch.setenv(f"ACCELERATE_DEEPSPEED_{setting}", value)
    plugin = DeepSpeedPlugin(hf_ds_config=hf.config)
    left = {join_path(path) for path in auto_paths(plugin.deepspeed_config)}
    assert left == {"gradient_clippin", "zero_optimization.overlap_comm"}
    with pytest.raises(ValueError, match="not found in kwargs"):
        plugin.deepspeed_config_process(must_match=False)
    result = run_cli("validate", write(tmp_path / "ds.json", ds), "--hf", "--json")
    refused = {p["path"] for p in json.loads(result.stdout) if '"auto" here is filled by no reader' in p["message"]}
    assert refused == left
    assert "did you mean 'gradient_clipping'?" in {p["fix"] for p in json.loads(result.stdout)}
