"""Hostile files, refused fast by the one bounded reader: special files, folders, files over the size limit or
nested too deep, YAML bombs, and values the schema alone lets through; and every reader of a DeepSpeed file checks
what validate checks."""

import json
import os
import time

import pytest
from hostile_input import fenced_cli, one_line_error, problems_of

from distsetup.errors import DistsetupError
from distsetup.formats.reading import MAX_CONFIG_BYTES, MAX_DEPTH, parse_yaml, read_yaml
from distsetup.formats.runconfig_load import load_run_config

# --- hostile files are refused fast by the one bounded reader ----------------------------------------


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda d: os.mkfifo(d / "fifo.json") or d / "fifo.json", "is a FIFO"),
        (lambda d: "/dev/zero", "is a character device"),
    ],
)
def test_special_files_are_refused_before_reading(tmp_path, make, words):
    result = fenced_cli("validate", make(tmp_path))
    assert result.returncode == 1 and words in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_folder_is_refused(tmp_path):
    (tmp_path / "config.yaml").mkdir()
    with pytest.raises(DistsetupError, match="is a directory"):
        read_yaml(tmp_path / "config.yaml")


def test_a_file_over_the_size_limit_is_refused(run_cli, tmp_path):
    (tmp_path / "big.json").write_text('{"x": "' + "a" * MAX_CONFIG_BYTES + '"}')
    one_line_error(run_cli("validate", tmp_path / "big.json"), "larger than 1 MiB")


@pytest.mark.parametrize(
    "name, text",
    [
        ("deep.json", "[" * 100_000 + "]" * 100_000),
        ("deep.yaml", "a: " + "[" * 100_000 + "]" * 100_000),
        ("deep65.json", "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)),  # below Python's recursion limit
        ("block.yaml", "".join(f"{'  ' * i}k{i}:\n" for i in range(MAX_DEPTH + 1)) + "  " * (MAX_DEPTH + 1) + "v: 1\n"),
    ],
)
def test_deep_nesting_is_one_line_everywhere(run_cli, tmp_path, monkeypatch, name, text):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(text)
    one_line_error(run_cli("validate", name), f"nests deeper than {MAX_DEPTH} levels")
    flag = "--config" if name.endswith(".yaml") else "--deepspeed_config"
    one_line_error(run_cli("launcher", flag, name, "-o", "-"), "nests deeper")
    doctor = run_cli("doctor", flag, name)
    problems = [line for line in doctor.stdout.splitlines() if "PROBLEM" in line]
    assert doctor.exit_code == 1 and len(doctor.stdout.splitlines()) < 30 and "nests deeper" in problems[0]


BILLION_LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)


@pytest.mark.parametrize(
    "text, words",
    [
        (BILLION_LAUGHS, "holds more than 10,000 values"),
        ("a: &a [*a]\n", "recursive alias"),
        ("training:\n  lr: [" + ", ".join(["1"] * 20_000) + "]\n", "holds more than 10,000 values"),
    ],
)
def test_yaml_bombs_are_refused_in_milliseconds(tmp_path, text, words):
    (tmp_path / "bomb.yaml").write_text(text)
    start = time.monotonic()
    with pytest.raises(DistsetupError, match=words):
        read_yaml(tmp_path / "bomb.yaml")
    # a guard against a hang (an unbounded expansion takes minutes and gigabytes), not a speed measure: loose enough
    # for a machine whose two cores a full test run shares (the 20,000-value list took over 3 s there once)
    assert time.monotonic() - start < 30


def test_a_few_anchors_still_work():
    assert parse_yaml("base: &lr 3.0e-4\ntraining: {lr: *lr}\n")["training"]["lr"] == 3e-4
    # merge keys override what they merge, also where a merged mapping merged one itself: no key written twice
    merged = parse_yaml("mid: &m {<<: {a: 1}, a: 2}\n<<: *m\nb: 3\n")
    assert merged == {"mid": {"a": 2}, "a": 2, "b": 3}


@pytest.mark.parametrize(
    "text, path, words",
    [
        ("training: {1: 2}\n", "training.1", "key 1 (int) is not a name"),
        ("yes: 1\n", "True", "(bool) is not a name"),
        ("model:\n  n_embd: 1e23\n", "model.n_embd", "out of range"),
        ("model:\n  n_layer: 100000\n", "model.n_layer", "at most 4096"),
        ("model:\n  vocab_size: 10000000\n  n_head: 5000\n", "model.n_head", "at most 1024"),
        ("model:\n  n_embd: 64.0\n", "model.n_embd", "not a whole number"),
        ("training:\n  micro_batch_size: 8.0\n", "training.micro_batch_size", "not a whole number"),
        ("training:\n  micro_batch_size: true\n", "training.micro_batch_size", "wrong type"),
        ("data:\n  type: files\n  paths: [missing.txt]\n", "data.paths[0]", "does not exist"),
    ],
)
def test_run_config_values_the_schema_alone_let_through(tmp_path, text, path, words):
    (tmp_path / "config.yaml").write_text(text)
    found = problems_of(tmp_path / "config.yaml")
    assert path in found and words in str(found[path]), found


def test_data_files_resolve_like_the_other_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "text.txt").write_text("hello")
    (tmp_path / "sub" / "config.yaml").write_text("data:\n  type: files\n  paths: [text.txt]\n")
    assert problems_of(tmp_path / "sub" / "config.yaml") == {}


def test_hostile_values_in_json_and_yaml_are_one_line(run_cli, tmp_path):
    (tmp_path / "date.yaml").write_text("training:\n  seed: 2024-13-45\n")
    one_line_error(run_cli("validate", tmp_path / "date.yaml"), "not valid YAML")
    (tmp_path / "digits.json").write_text('{"train_batch_size": ' + "9" * 5000 + "}")
    one_line_error(run_cli("validate", tmp_path / "digits.json"), "not valid JSON")
    with pytest.raises(DistsetupError, match="not valid YAML"):
        load_run_config(None, ["training.seed=" + "9" * 5000])


@pytest.mark.parametrize(
    "text, words",
    [
        ("model:\n  type: gpt\n  n_layer: 2\n n_head: 4\n", "not valid YAML: line 4, column 2"),
        ("- a\n- b\n", "must hold a mapping of sections"),
        ("training:\n  seed: 2024-13-45\n", "not valid YAML"),
        ("training:\n  lr: 0.1\ntraining:\n  max_steps: 5\n", "key 'training' is written a second time"),
    ],
)
def test_validate_fix_says_what_it_cannot_read_in_one_line(run_cli, tmp_path, text, words):
    """--fix read the file with its round-trip parser first: a YAML error was ruamel's traceback (a list: an
    AttributeError), where validate without --fix says one line. The file is left as it was."""
    config = tmp_path / "config.yaml"
    config.write_text(text)
    one_line_error(run_cli("validate", "--fix", config), words)
    assert config.read_text() == text


# --- every reader of a DeepSpeed file checks what validate checks ----------------------------------

TYPO = {"zero_optimizaton": {"stage": 2}, "train_micro_batch_size_per_gpu": 1}


@pytest.mark.parametrize("command", ["launcher", "slurm"])
def test_a_typo_deepspeed_accepts_silently_is_refused_by_the_launchers(run_cli, here, command):
    (here / "typo.json").write_text(json.dumps(TYPO))
    result = run_cli(command, "--deepspeed_config", "typo.json", "--num_gpus_per_node", "1", "-o", "-")
    one_line_error(
        result,
        "zero_optimizaton",
        "did you mean 'zero_optimization'",
        "`distsetup validate typo.json --world_size 1` lists every problem",
    )


def test_doctor_reports_the_typo(run_cli, here):
    (here / "typo.json").write_text(json.dumps(TYPO))
    result = run_cli("doctor", "--deepspeed_config", "typo.json", "--json")
    assert result.exit_code == 1
    assert any("zero_optimizaton" in f["message"] for f in json.loads(result.stdout) if f["level"] == "problem")


# --- a config of another kind than the flag takes is said as such, with where it goes ----------------------------

GIVEN_AS_ANOTHER_KIND = {  # name -> (arguments, what is said)
    "DeepSpeed file as --config": (
        ["slurm", "--num_gpus_per_node", 1, "--config", "ds.json", "-o", "-"],
        "ds.json: this is a DeepSpeed config (zero_optimization), not a run config. HINT: give it as "
        "--deepspeed_config",
    ),
    "run config as --deepspeed_config": (
        ["launcher", "--use_deepspeed", "--deepspeed_config", "config.yaml", "--num_gpus_per_node", 1, "-o", "-"],
        "this is a run config (model, training), not a DeepSpeed config. Fix: give it as --config",
    ),
    "FSDP file as --deepspeed_config": (
        ["launcher", "--use_deepspeed", "--deepspeed_config", "fsdp.json", "--num_gpus_per_node", 1, "-o", "-"],
        "this is an FSDP config (fsdp_version",
    ),
    "a run config in JSON": (["validate", "run.json"], "this is a run config (model), not a DeepSpeed config"),
    # a key of another kind in a config of its own kind is an unknown key, said by its own rules
    "a stray key": (["validate", "stray.yaml"], "train_batch_size: unknown key 'train_batch_size'"),
    # keys several kinds share (bf16, activation_checkpointing, an fsdp_config block) make no file its own kind
    "TrainingArguments as --deepspeed_config": (
        ["launcher", "--use_deepspeed", "--deepspeed_config", "ta.json", "--script", "t.py", "-o", "-"],
        "this is the HF Trainer's TrainingArguments (per_device_train_batch_size), not a DeepSpeed config",
    ),
    "an Accelerate file as --fsdp_config": (
        ["launcher", "--use_fsdp", "--fsdp_config", "acc.yaml", "-o", "-"],
        "this is an Accelerate config (compute_environment, distributed_type), not an FSDP config",
    ),
    "an HF FSDP file as --deepspeed_config": (
        ["launcher", "--use_deepspeed", "--deepspeed_config", "hf_fsdp.json", "-o", "-"],
        "this is an FSDP config (fsdp_version), not a DeepSpeed config",
    ),
}


@pytest.mark.parametrize("case", GIVEN_AS_ANOTHER_KIND)
def test_a_config_of_another_kind_is_said_to_be_one(run_cli, tmp_path, monkeypatch, case):
    """A DeepSpeed file given as --config was read as a run config ("bf16 is training.precision here", which invited
    editing the DeepSpeed file); a run config given as --deepspeed_config got "unknown key 'data'" and DeepSpeed's
    sixty keys; an FSDP file "did you mean 'activation_checkpointing'?"."""
    monkeypatch.chdir(tmp_path)
    assert run_cli("deepspeed", "--zero_stage", 2, "-o", "ds.json").exit_code == 0
    assert run_cli("fsdp", "-o", "fsdp.json").exit_code == 0
    (tmp_path / "config.yaml").write_text("model:\n  n_layer: 2\ntraining:\n  max_steps: 5\n")
    (tmp_path / "run.json").write_text(json.dumps({"model": {"n_layer": 2}}))
    (tmp_path / "stray.yaml").write_text("model:\n  n_layer: 2\ntrain_batch_size: 8\n")
    training_args = {
        "output_dir": "o",
        "per_device_train_batch_size": 2,
        "bf16": True,
        "gradient_accumulation_steps": 1,
    }
    (tmp_path / "ta.json").write_text(json.dumps(training_args))
    (tmp_path / "acc.yaml").write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nfsdp_config: {}\n")
    (tmp_path / "hf_fsdp.json").write_text(json.dumps({"activation_checkpointing": True, "fsdp_version": 2}))
    args, said = GIVEN_AS_ANOTHER_KIND[case]
    result = run_cli(*args)
    if args[0] == "validate":
        assert result.exit_code == 1 and said in result.stdout, result.output
    else:
        one_line_error(result, said)


def test_a_script_given_to_validate_is_said_to_be_no_config(run_cli, tmp_path, monkeypatch):
    """validate run_training.sh said "is not valid JSON ... fix the JSON syntax (no comments or trailing commas)"."""
    monkeypatch.chdir(tmp_path)
    assert run_cli("launcher", "--num_gpus_per_node", 1, "-o", "run_training.sh").exit_code == 0
    one_line_error(run_cli("validate", "run_training.sh"), "run_training.sh is no config file validate reads")
    one_line_error(run_cli("validate", "missing.sh"), "cannot read")  # a file not there is said as before
