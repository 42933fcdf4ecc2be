"""The configs users bring from the guides and the HF Trainer: other tools' names read with their meaning, each said
in a note; two spellings that disagree, and ambiguous names, refused; suggestions in other tools' words;
`validate --fix`; the Accelerate DeepSpeed block held to the DeepSpeed file's fp16 rule."""

import dataclasses
import json
import re

import pytest
import yaml
from guide_configs import FREE_TRANSFORMER
from repo import REPO

from distsetup.errors import DistsetupError
from distsetup.formats.other_names import ELSEWHERE, HF, OTHER_NAMES
from distsetup.formats.reading import parse_yaml
from distsetup.formats.runconfig import SECTIONS, TrainingConfig
from distsetup.formats.runconfig_load import check_run_config, load_run_config


def training_arguments_fields() -> set[str]:
    from transformers import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments)}


def test_the_hf_trainers_names_are_its_own_field_names():
    fields = training_arguments_fields()
    ours = {key for (_, key), other in OTHER_NAMES.items() if other.origin == HF}
    ours |= {key for key, (origin, _) in ELSEWHERE.items() if origin == HF}
    assert ours - fields == set()
    # the Trainer's names the issue lists are each read here, under that name or under another
    listed = {"learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "num_train_epochs"}
    listed |= {"max_grad_norm", "bf16", "fp16", "gradient_checkpointing", "logging_steps", "save_steps"}
    listed |= {"eval_steps", "warmup_steps", "weight_decay", "seed", "output_dir"}
    same = {f.name for f in dataclasses.fields(TrainingConfig)}
    assert listed <= fields and all(name in same or ("training", name) in OTHER_NAMES for name in listed)
    for (section, _), other in OTHER_NAMES.items():  # each is read as a key that exists
        target_section, key = other.ours.split(".")
        assert section in SECTIONS and key in {f.name for f in dataclasses.fields(SECTIONS[target_section])}


def test_the_free_transformer_guide_block_is_read_with_its_meaning():
    raw = parse_yaml(FREE_TRANSFORMER)  # as distsetup reads it: 2e-4 is a number
    checked = check_run_config(raw)
    assert checked.problems == []
    t, fsdp = raw["training"], raw["distributed"]["fsdp"]
    assert (t["micro_batch_size"], t["lr"], t["grad_clip"]) == (4, 2e-4, 1.0)
    assert (t["precision"], t["activation_checkpointing"]) == ("bf16", "full")
    assert fsdp["fsdp_sharding_strategy"] == "FULL_SHARD" and fsdp["mixed_precision"] == "bf16"
    assert (
        fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP" and fsdp["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    )
    said = " ".join(checked.notes)
    for name in ("learning_rate", "batch_size", "bf16", "gradient_checkpointing", "gradient_clip_norm"):
        assert f"training.{name} (" in said
    # FSDP1's knobs are said, not dropped silently: FSDP2 has no such argument
    for unused in ("fsdp_backward_prefetch", "fsdp_forward_prefetch", "fsdp_buffer_dtype", "fsdp_min_num_params"):
        assert f"distributed.{unused} is" in said
    assert checked.written["training.lr"] == "training.learning_rate"


@pytest.mark.parametrize(
    "training, path, words",
    [
        ({"lr": 1e-3, "learning_rate": 2e-4}, "training.learning_rate", "training.lr 0.001"),
        ({"bf16": True, "precision": "fp16"}, "training.bf16", "different values"),
        (
            {"batch_size": 4, "per_device_train_batch_size": 8},
            "training.batch_size",
            "training.batch_size 4 and training.per_device_train_batch_size 8",
        ),
        ({"train_batch_size": 64}, "training.train_batch_size", "global batch"),
    ],
)
def test_two_spellings_that_disagree_and_ambiguous_names_are_problems(training, path, words):
    problems = {p.path: p for p in check_run_config({"training": training}).problems}
    assert path in problems and words in str(problems[path]), problems


def test_the_same_setting_in_both_spellings_and_the_same_value_is_read_once():
    checked = check_run_config(raw := {"training": {"lr": 2e-4, "learning_rate": 2e-4, "bf16": False}})
    assert checked.problems == [] and raw["training"] == {"lr": 2e-4}
    assert any("training.bf16: false" in note for note in checked.notes)


@pytest.mark.parametrize(
    "section, key, words",
    [
        ("training", "lr_scheduler_type", "lr_scheduler_type is not a choice here: distsetup's trainer runs"),
        ("training", "warmup_ratio", "warmup_ratio is training.warmup_steps here"),
        ("training", "mixed_precision", "mixed_precision is training.precision here"),
        ("distributed", "zero_stage", "zero_stage is zero_optimization.stage of the DeepSpeed file"),
        ("distributed", "learning_rate", "learning_rate is training.lr here"),  # a known name in another section
        ("distributed", "dynamo_backend", "dynamo_backend is training.compile here"),  # was "did you mean 'backend'?"
        ("distributed", "num_processes", "num_processes is the launch script's: --num_gpus_per_node"),
    ],
)
def test_unknown_keys_that_other_tools_know_get_their_place_here(section, key, words):
    (problem,) = check_run_config({section: {key: 1}}).problems
    assert problem.path == f"{section}.{key}" and problem.fix.startswith(words) and "valid keys" not in problem.fix


@pytest.mark.parametrize(
    "section, key, fix",
    [
        ("training", "micro_batch_sise", "did you mean 'micro_batch_size'?"),
        ("training", "learning_rte", "did you mean 'learning_rate' (read as lr)?"),
        ("training", "lerning_rate", "did you mean 'learning_rate' (read as lr)?"),
        (
            "distributed",
            "gradient_accumulation_step",
            "did you mean 'gradient_accumulation_steps' (read as training.gradient_accumulation_steps)?",
        ),
        ("model", "seq_lenn", "did you mean 'seq_len'? seq_len is model.block_size here."),  # a name read nowhere
        # a model's own setting, not a typo of another section's name (it was "did you mean 'num_workers'?")
        (
            "model",
            "num_experts",
            "the model's own settings go under model.args (its builder's arguments: model.args.num_experts), or in "
            "the config.json of model.hf_path.",
        ),
    ],
)
def test_typos_are_matched_against_other_tools_names_too_and_say_what_that_name_is_read_as(section, key, fix):
    (problem,) = check_run_config({section: {key: 1}}).problems
    assert problem.fix == fix
    if key == "lerning_rate":
        assert str(problem) == "training.lerning_rate: unknown key 'lerning_rate'. Fix: " + fix


def test_accelerates_names_are_its_own_config_keys():
    """Its config's keys (formats.accelerate.KEYS, which test_validate_against_clients.py holds to Accelerate's own
    ClusterConfig), its deepspeed_config block's and its launch flags."""
    from distsetup.formats.accelerate import DEEPSPEED_KEYS, KEYS
    from distsetup.formats.other_names import ACCELERATE

    ours = {key for key, (origin, _) in ELSEWHERE.items() if origin == ACCELERATE}
    launch_flags = {"dynamo_backend"}  # accelerate launch's --dynamo_backend (dynamo_config's key in its config)
    assert len(ours) >= 10 and ours <= KEYS | DEEPSPEED_KEYS | launch_flags


@pytest.mark.parametrize("stray", ["per_device_train_batch_size: 8", "compute_environment: LOCAL_MACHINE"])
def test_a_run_config_with_a_stray_key_of_another_tools_is_a_run_config_with_an_unknown_key(run_cli, tmp_path, stray):
    """Bug: one top-level key of TrainingArguments' or Accelerate's made a whole run config that file's kind: validate
    passed it as TrainingArguments (or listed its sections as unknown Accelerate keys), the launcher called it no run
    config. Its sections say it is one."""
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  type: gpt\ntraining:\n  max_steps: 5\n{stray}\n")
    key = stray.split(":")[0]
    validated = run_cli("validate", config)
    assert validated.exit_code == 1 and f"{key}: unknown key '{key}'. Fix: {key} is " in validated.stdout
    assert "run config, 1 problem(s)" in validated.output
    launched = run_cli("launcher", "--config", config, "--num_gpus_per_node", 1, "-o", tmp_path / "run.sh")
    assert launched.exit_code == 1 and f"unknown key '{key}'" in launched.stderr and "this is " not in launched.stderr


def test_a_key_close_to_no_name_gets_the_list_of_valid_keys():
    (problem,) = check_run_config({"training": {"xyzzy_foo": 1}}).problems
    valid = sorted(f.name for f in dataclasses.fields(TrainingConfig))
    assert problem.fix == "valid keys: " + ", ".join(valid) + "."


def test_validate_prints_a_note_per_name_and_passes(run_cli, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(FREE_TRANSFORMER)
    result = run_cli("validate", config)
    notes = [line for line in result.stdout.splitlines() if ": note: " in line]
    assert result.exit_code == 0 and len(notes) == 14, result.stdout


def test_fix_rewrites_into_distsetups_keys_keeping_comments_and_order(run_cli, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(FREE_TRANSFORMER)
    result = run_cli("validate", "--fix", config)
    assert result.exit_code == 0, result.output
    text = config.read_text()
    assert re.search(r"\n  micro_batch_size: 4 +# per GPU\n", text) and "FULL_STATE_DICT   # one file on save\n" in text
    assert list(yaml.safe_load(text)["training"]) == [
        "micro_batch_size",
        "lr",
        "activation_checkpointing",
        "precision",
        "grad_clip",
    ]
    assert yaml.safe_load(text)["distributed"]["fsdp"] == {
        "fsdp_sharding_strategy": "FULL_SHARD",
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_state_dict_type": "FULL_STATE_DICT",
        "fsdp_reduce_dtype": "float32",
        "mixed_precision": "bf16",
    }
    again = run_cli("validate", config)
    assert again.exit_code == 0 and ": note: " not in again.stdout  # clean: nothing left to read another way
    assert load_run_config(config).training.lr == 2e-4


def test_fix_writes_nothing_while_a_problem_remains(run_cli, tmp_path):
    config = tmp_path / "config.yaml"
    text = "training:\n  learning_rate: 2e-4   # the guide's\n  lr_scheduler_type: cosine\n"
    config.write_text(text)
    result = run_cli("validate", "--fix", config)
    assert result.exit_code == 1 and config.read_text() == text
    assert result.stderr.startswith("Error: ") and "lr_scheduler_type" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_an_accelerate_deepspeed_block_in_fp16_at_zero_0_is_the_deepspeed_files_problem(run_cli, tmp_path):
    accelerate = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"zero_stage": 0},
        "mixed_precision": "fp16",
        "num_machines": 1,
        "num_processes": 2,
    }
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(accelerate))
    result = run_cli("validate", path, "--json")
    problems = {p["path"]: p for p in json.loads(result.stdout)}
    assert result.exit_code == 1 and "does not loss-scale fp16" in problems["mixed_precision"]["message"]
    path.write_text(yaml.safe_dump({**accelerate, "deepspeed_config": {"zero_stage": 1}}))
    assert run_cli("validate", path).exit_code == 0


@pytest.mark.parametrize("flags", [(), ("--model", "medium", "--gpu_memory", "24GB", "--precision", "bf16")])
def test_init_and_the_shipped_config_keep_distsetups_own_spelling(run_cli, tmp_path, monkeypatch, flags):
    shipped = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert check_run_config(shipped).notes == []
    monkeypatch.chdir(tmp_path)
    assert run_cli("init", "--yes", *flags).exit_code == 0
    written = yaml.safe_load((tmp_path / "config" / "config.yaml").read_text())
    checked = check_run_config(written, tmp_path / "config")
    assert checked.notes == [] and checked.problems == []


def test_chunked_loss_of_another_type_is_the_schemas_problem():
    """A list (unhashable) raised TypeError's traceback; 1 was read as true, always."""
    for value in ("[always]", "1"):
        with pytest.raises(DistsetupError, match="training.chunked_loss"):
            load_run_config(None, [f"training.chunked_loss={value}"])


def test_fix_rewrites_chunked_loss_yes_as_the_trainer_reads_it(run_cli, tmp_path):
    """`chunked_loss: yes` is YAML 1.1's true to the trainer (PyYAML) and the string "yes" to --fix's YAML 1.2 reader:
    both read it as always (--fix left it as it was, saying nothing)."""
    config = tmp_path / "config.yaml"
    config.write_text("training:\n  chunked_loss: yes   # slice the loss\n")
    assert load_run_config(config).training.chunked_loss == "always"
    result = run_cli("validate", "--fix", config)
    assert result.exit_code == 0, result.output
    assert re.fullmatch(r"training:\n  chunked_loss: always +# slice the loss\n", config.read_text())


def test_fix_takes_a_warmup_ratio_in_steps_where_the_run_config_gives_its_steps(run_cli, tmp_path):
    """The HF Trainer's warmup_ratio: `--fix` could not convert it, though max_steps was in the same file."""
    config = tmp_path / "config.yaml"
    config.write_text("training:\n  max_steps: 1000\n  warmup_ratio: 0.033   # the guide's\n")
    result = run_cli("validate", "--fix", config)
    assert result.exit_code == 0, result.output
    assert re.fullmatch(r"training:\n  max_steps: 1000\n  warmup_steps: 33 +# the guide's\n", config.read_text())
    epochs = "training:\n  epochs: 3\n  warmup_ratio: 0.1\n"  # no step count to take it in: by hand
    config.write_text(epochs)
    assert run_cli("validate", "--fix", config).exit_code == 1 and config.read_text() == epochs
