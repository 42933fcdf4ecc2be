import dataclasses
import json
from pathlib import Path

import pytest
from hostile_input import problems_of
from repo import REPO

from distsetup.errors import DistsetupError
from distsetup.formats.problems import load_schema
from distsetup.formats.runconfig import SECTIONS, RunConfig, TrainingConfig, run_config_schema
from distsetup.formats.runconfig_load import load_run_config


def write_yaml(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_defaults_and_example_load():
    assert load_run_config(None) == RunConfig()
    example = load_run_config(REPO / "config" / "config.yaml")
    assert example.distributed.backend == "ddp" and example.training.lr == 1e-3


def test_shipped_schema_is_generated_from_the_dataclasses():
    """`make schemas` regenerates it; fields and schema can never drift apart."""
    assert load_schema("run_config") == json.loads(json.dumps(run_config_schema()))
    for name, cls in SECTIONS.items():
        assert set(load_schema("run_config")["properties"][name]["properties"]) == {
            f.name for f in dataclasses.fields(cls)
        }


def test_overrides_parse_values_as_yaml(tmp_path):
    config = load_run_config(
        write_yaml(tmp_path, "training:\n  lr: 3e-4\n"),
        ["training.max_steps=7", "model.n_layer=3", "training.betas=[0.8, 0.9]"],
    )
    assert config.training.lr == 3e-4 and config.training.max_steps == 7
    assert config.model.n_layer == 3 and config.training.betas == [0.8, 0.9]


def test_an_override_sets_one_key_inside_a_mapping_and_keeps_the_rest(tmp_path):
    """model.args.experts=64 (an MoE user varying the experts): the file's other builder arguments stay."""
    path = write_yaml(tmp_path, "model:\n  type: python\n  builder: m:build\n  args: {width: 64, experts: 8}\n")
    (tmp_path / "m.py").write_text("def build(width, experts):\n    pass\n\ndef build_data(split, val):\n    pass\n")
    data = ["data.type=python", "data.builder=m:build_data"]
    config = load_run_config(path, ["model.args.experts=64", *data, "data.args.val.n=7"])
    assert config.model.args == {"width": 64, "experts": 64} and config.data.args == {"val": {"n": 7}}
    with pytest.raises(DistsetupError, match=r"^override 'model.args.width.x=1': model.args.width is not a mapping"):
        load_run_config(path, ["model.args.width.x=1"])
    with pytest.raises(DistsetupError, match="section.key=value"):
        load_run_config(path, ["model.args.=1"])


def test_guides_keys_select_the_backend(tmp_path):
    (tmp_path / "ds.json").write_text("{}")
    path = write_yaml(tmp_path, "distributed:\n  use_deepspeed: true\n  deepspeed_config: ds.json\n")
    assert load_run_config(path).distributed.backend == "deepspeed"
    path = write_yaml(tmp_path, "distributed:\n  use_fsdp: true\n")
    assert load_run_config(path).distributed.backend == "fsdp"


def test_a_backends_file_alone_selects_it_and_one_left_unread_is_said(tmp_path):
    """A file without a backend trained DDP, the file unread, without a word."""
    for name in ("ds.json", "f.json"):
        (tmp_path / name).write_text("{}")
    path = write_yaml(tmp_path, "distributed:\n  fsdp_config: f.json\n")
    assert load_run_config(path).distributed.backend == "fsdp"
    path = write_yaml(tmp_path, "distributed:\n  deepspeed_config: ds.json\n")
    assert load_run_config(path).distributed.backend == "deepspeed"
    path = write_yaml(tmp_path, "distributed:\n  backend: ddp\n  deepspeed_config: ds.json\n")
    loaded = load_run_config(path)
    assert loaded.distributed.backend == "ddp"
    assert loaded.notes == [
        "distributed.deepspeed_config is read by backend deepspeed only: this run trains ddp without it."
    ]
    path = write_yaml(tmp_path, "distributed:\n  use_deepspeed: false\n  deepspeed_config: ds.json\n")
    assert load_run_config(path).distributed.backend == "ddp"  # turned off, as HF-style configs write it
    path = write_yaml(
        tmp_path, "distributed:\n  use_deepspeed: false\n  deepspeed_config: ds.json\n  fsdp_config: f.json\n"
    )
    assert load_run_config(path).distributed.backend == "fsdp"
    path = write_yaml(tmp_path, "distributed:\n  deepspeed_config: ds.json\n  fsdp_config: f.json\n")
    with pytest.raises(DistsetupError, match="both given, and no backend says which one trains"):
        load_run_config(path)
    path = write_yaml(tmp_path, "distributed:\n  backend: fsdp\n  deepspeed_config: ds.json\n  fsdp_config: f.json\n")
    assert load_run_config(path).distributed.backend == "fsdp"


@pytest.mark.parametrize(
    "text, message",
    [
        ("trainig:\n  lr: 1\n", "did you mean 'training'"),
        ("training:\n  precision: bf32\n", "training.precision"),
        ("training:\n  micro_batch_size: 0\n", "training.micro_batch_size"),
        ("distributed:\n  backend: deepspeed\n", "needs a DeepSpeed file"),
        ("distributed:\n  use_deepspeed: true\n  use_fsdp: true\n", "both true"),
        ("model:\n  n_embd: 30\n  n_head: 4\n", "not a multiple of n_head"),
        ("training:\n  scale_lr: linear\n", "needs base_batch_size"),
        ("distributed:\n  backend: fsdp\n  fsdp_config: nowhere.json\n", "does not exist"),
        ("model:\n  type: python\n", "model.type python needs builder"),
        ("model:\n  builder: config:build\n", r"builder is read only with model.type python \(this is gpt\)"),
        ("data:\n  collate: config:collate\n", "collate is read only with data.type python"),
        ("data:\n  type: python\n  builder: nope_module:build\n", "nope_module is not in the run config.s folder"),
        ("model:\n  layer_cls: Block\n  layer_classes: [Other]\n", "name different classes"),
        ("- a list\n", "mapping of sections"),
        ("training:\n  betas: [1.5, 0.9]\n", r"training.betas: \[1.5, 0.9\] are not both in \[0, 1\)"),
        ("training: [\n", "not valid YAML: line 2, column 1: expected the node content"),
        ("training:\n  max_steps: 3\n\tlr: 0.1\n", r"line 3, column 1: .* \(a tab: YAML indents with spaces\)"),
        # PyYAML keeps a repeated key's last value: a second section appended dropped the first's settings
        (
            "training:\n  lr: 0.1\nmodel:\n  n_layer: 2\ntraining:\n  max_steps: 5\n",
            "line 5, column 1: key 'training' "
            r"is written a second time \(first at line 1\)",
        ),
        ("training:\n  lr: 0.1\n  lr: 0.2\n", "line 3, column 3: key 'lr' is written a second time"),
        # torch's timedelta overflowed in init_process_group: a traceback on every rank
        ("distributed:\n  timeout_minutes: 1e23\n", r"timeout_minutes: 1e\+23 is out of range.* at most 10080"),
    ],
)
def test_bad_config_is_one_clear_error(tmp_path, text, message):
    with pytest.raises(DistsetupError, match=message) as info:
        load_run_config(write_yaml(tmp_path, text))
    assert "\n" not in info.value.message


@pytest.mark.parametrize("section", ["model", "data"])
def test_a_reference_the_run_never_reads_is_one_stray_problem_whether_its_module_exists_or_not(tmp_path, section):
    """model.builder with the built-in GPT, data.builder with token data: the fix is the type or the key, not the
    module (which was looked for, and said missing first where the folder had no such module)."""
    for module in ("no_such_module_anywhere", "config"):
        with pytest.raises(DistsetupError, match=rf"builder is read only with {section}.type python") as info:
            load_run_config(write_yaml(tmp_path, f"{section}:\n  builder: {module}:build\n"))
        assert "and 1 more" not in info.value.message and f"module {module}" not in info.value.message


@pytest.mark.parametrize("key", ["max_position_embeddings", "n_positions"])
def test_a_hugging_face_folder_needs_its_config_and_room_for_the_block(tmp_path, key):
    """GPT-2's learned positions end at n_positions: a longer block was an IndexError on every rank at step 1."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "gpt2", key: 128}))
    hf = "model:\n  type: hf\n  hf_path: {path}\n  block_size: {block}\n"
    load_run_config(write_yaml(tmp_path, hf.format(path="model", block=128)))  # fits
    with pytest.raises(DistsetupError, match=rf"model.block_size: 256 is above the model's {key}, 128 \("):
        load_run_config(write_yaml(tmp_path, hf.format(path="model", block=256)))
    with pytest.raises(DistsetupError, match="model.hf_path: elsewhere has no config.json"):
        load_run_config(write_yaml(tmp_path, hf.format(path="elsewhere", block=128)))


def test_an_encoder_decoder_folder_is_refused_as_the_trainer_refuses_it(tmp_path):
    """validate said "no problems" of a T5 or SwitchTransformers folder, which the trainer then refused on every rank
    (transformers builds no causal LM of it); config.json says it without transformers. BART it builds (the review's
    find: refusing every encoder-decoder refused it too)."""
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text(json.dumps({"model_type": "t5", "is_encoder_decoder": True}))
    with pytest.raises(DistsetupError) as refused:
        load_run_config(write_yaml(tmp_path, "model:\n  type: hf\n  hf_path: t5\n"))
    assert refused.value.message.endswith(
        "config.yaml: model.hf_path: t5 holds an encoder-decoder (t5); model.type hf trains causal LMs "
        "(AutoModelForCausalLM). Fix: train it as model.type python: a builder that returns the model, and its own "
        ".loss (docs/own-code.md)."
    )
    (tmp_path / "bart").mkdir()  # an encoder-decoder of which transformers builds a causal LM (its decoder): trained
    (tmp_path / "bart" / "config.json").write_text(json.dumps({"model_type": "bart", "is_encoder_decoder": True}))
    assert load_run_config(write_yaml(tmp_path, "model:\n  type: hf\n  hf_path: bart\n")).model.hf_path == "bart"


def test_missing_file_and_bad_override():
    with pytest.raises(DistsetupError, match="cannot read run config"):
        load_run_config("no/such/config.yaml")
    with pytest.raises(DistsetupError, match="section.key=value"):
        load_run_config(None, ["lr=1"])


def test_a_problem_names_the_override_that_set_its_key_not_the_file(tmp_path):
    path = write_yaml(tmp_path, "training:\n  lr: 1.0e-3\n")
    with pytest.raises(DistsetupError, match=r"in the override training\.lr=abc: training\.lr:"):
        load_run_config(path, ["training.lr=0.1", "training.lr=abc"])  # the last one counts
    with pytest.raises(DistsetupError, match=r"in the override distributed\.deepspeed_config=nope\.json:"):
        load_run_config(path, ["distributed.backend=deepspeed", "distributed.deepspeed_config=nope.json"])
    with pytest.raises(DistsetupError, match=r"in the override data\.paths=\['nope\.txt'\]: data\.paths\[0\]:"):
        load_run_config(path, ["data.type=files", "data.paths=['nope.txt']"])  # an item of the override's list
    with pytest.raises(DistsetupError, match=f"in {path}: training.lr:"):
        load_run_config(write_yaml(tmp_path, "training:\n  lr: abc\n"), ["training.max_steps=3"])
    with pytest.raises(DistsetupError, match=r"in the override training\.scale_lr=linear: training\.base_batch_size:"):
        load_run_config(write_yaml(tmp_path, "training:\n  lr: 1.0e-3\n"), ["training.scale_lr=linear"])  # across keys
    files = write_yaml(tmp_path, "data:\n  type: files\n")  # the file's problem, whatever an override's key is called
    with pytest.raises(DistsetupError, match=f"in {files}: data.paths: data type files needs"):
        load_run_config(files, ["model.type=gpt"])
    with pytest.raises(DistsetupError, match=r"in the override model\.args\.experts=4: model\.args:"):
        load_run_config(None, ["model.args.experts=4"])  # a key inside the one at fault
    both = write_yaml(tmp_path, "distributed:\n  use_deepspeed: true\n  use_fsdp: true\n")
    with pytest.raises(DistsetupError, match=f"in {both}: distributed: use_deepspeed and use_fsdp are both true"):
        load_run_config(both, ["distributed.timeout_minutes=5"])  # a section's problem: not any override under it
    with pytest.raises(DistsetupError, match=r"in the override model\.n_head=7: model\.n_embd:"):
        load_run_config(write_yaml(tmp_path, "model:\n  n_embd: 64\n"), ["model.n_head=7"])
    with pytest.raises(DistsetupError, match=r"in the override trainig\.lr=1e-3: trainig: unknown key"):
        load_run_config(write_yaml(tmp_path, "training:\n  lr: 0.1\n"), ["trainig.lr=1e-3"])  # a section's typo


def test_train_names_a_missing_deepspeed_file_by_its_flag(tmp_path):
    from distsetup.train import load_config, parse_args

    config = write_yaml(tmp_path, "training:\n  max_steps: 3\n")
    with pytest.raises(DistsetupError, match=r"^--deepspeed nope\.json: file nope\.json does not exist\."):
        load_config(parse_args(["--config", str(config), "--deepspeed", "nope.json"]))
    (tmp_path / "ds.json").write_text("{}")  # found next to the config, as the run config's own paths are
    assert load_config(parse_args(["--config", str(config), "--deepspeed", "ds.json"])).distributed.backend == (
        "deepspeed"
    )


def test_the_users_overrides_win_over_deepspeed_flag_of_the_launch_script(tmp_path):
    """The scripts pass `--deepspeed FILE` and then the user's key=value arguments, which their header says override
    any key: the flag's keys came after them and won (another file, or another backend, trained the script's)."""
    from distsetup.train import load_config, parse_args

    config = write_yaml(tmp_path, "training:\n  max_steps: 3\n")
    for name in ("ds.json", "other.json"):
        (tmp_path / name).write_text("{}")
    script = ["--config", str(config), "--deepspeed", "ds.json"]
    other = load_config(parse_args([*script, "distributed.deepspeed_config=other.json"])).distributed
    assert (other.backend, Path(other.deepspeed_config).name) == ("deepspeed", "other.json")
    assert load_config(parse_args([*script, "distributed.backend=fsdp"])).distributed.backend == "fsdp"


def test_an_override_of_the_runs_length_replaces_the_files_other(tmp_path):
    def config(name, training):
        (tmp_path / name).write_text(f"training:\n  {training}\n")
        return tmp_path / name

    by_steps, by_epochs, hf_epochs = (
        config("s.yaml", "max_steps: 150"),
        config("e.yaml", "epochs: 2"),
        config("h.yaml", "num_train_epochs: 2"),
    )
    run = load_run_config(by_steps, ["training.epochs=3"]).training
    assert (run.epochs, run.max_steps) == (3, TrainingConfig.max_steps)  # the file's 150 gone: unused beside epochs
    assert load_run_config(by_steps, ["training.num_train_epochs=3"]).training.epochs == 3  # the HF Trainer's name
    assert load_run_config(by_steps, ["training.epochs=null"]).training.max_steps == 150  # unset: the file's stays
    for epochs in (by_epochs, hf_epochs):
        run = load_run_config(epochs, ["training.max_steps=5"]).training
        assert (run.epochs, run.max_steps) == (None, 5)
    with pytest.raises(DistsetupError, match="epochs and max_steps are both set"):
        load_run_config(by_steps, ["training.epochs=3", "training.max_steps=4"])  # both on the command line
    with pytest.raises(DistsetupError, match="epochs and max_steps are both set"):
        load_run_config(config("b.yaml", "epochs: 2\n  max_steps: 9"))


def test_an_override_under_another_name_replaces_the_files_setting(tmp_path):
    """Bug: `training.learning_rate=1e-3` on the command line was refused beside the file's `lr` (one setting written
    twice), where an override of `lr` replaces it: the command line wins, under any name the setting is read from."""
    path = write_yaml(tmp_path, "training:\n  lr: 0.1\n  fp16: true\ndistributed:\n  gradient_accumulation_steps: 2\n")
    run = load_run_config(path, ["training.learning_rate=1e-3", "training.bf16=true"]).training
    assert (run.lr, run.precision) == (1e-3, "bf16")  # fp16 written in the file is the same setting: replaced
    assert load_run_config(path, ["training.gradient_accumulation_steps=4"]).training.gradient_accumulation_steps == 4
    bf16 = write_yaml(tmp_path, "training:\n  precision: bf16\n")
    assert load_run_config(bf16, ["training.fp16=false"]).training.precision == "bf16"  # false sets nothing: kept
    hf = write_yaml(tmp_path, "training:\n  learning_rate: 0.1\n")
    assert load_run_config(hf, ["training.lr=2e-3"]).training.lr == 2e-3
    with pytest.raises(DistsetupError, match="set one setting \\(training.lr\\) to different values"):
        load_run_config(None, ["training.lr=0.1", "training.learning_rate=0.2"])  # both on the command line


def test_the_forms_users_write_for_own_keys_are_read_as_meant(tmp_path):
    """`yes` for chunked_loss (YAML's true), the HF Trainer's report_to as one string; "all" is refused (no list here
    means TensorBoard where installed, not every integration)."""
    training = load_run_config(None, ["training.chunked_loss=yes", "training.report_to=none"]).training
    assert (training.chunked_loss, training.report_to) == ("always", [])
    assert load_run_config(None, ["training.chunked_loss=false"]).training.chunked_loss == "never"
    assert load_run_config(None, ["training.report_to=tensorboard"]).training.report_to == ["tensorboard"]
    with pytest.raises(DistsetupError, match="training.report_to"):
        load_run_config(None, ["training.report_to=all"])


def test_override_that_is_not_yaml_is_one_clear_error():
    with pytest.raises(DistsetupError, match="not valid YAML"):
        load_run_config(None, ["distributed.fsdp_config=[x].json"])
    with pytest.raises(DistsetupError, match="not valid YAML"):
        load_run_config(None, ["distributed.deepspeed_config=@ds.json"])


def test_explicit_backend_wins_over_the_guides_keys_and_a_mismatch_is_reported(tmp_path):
    path = write_yaml(tmp_path, "distributed:\n  backend: single\n  use_fsdp: true\n")
    with pytest.raises(DistsetupError, match="use_fsdp is true but backend is single"):
        load_run_config(path)


def test_every_backend_a_run_config_names_is_one_the_trainer_has():
    from distsetup.formats.runconfig import BACKENDS
    from distsetup.training.backends import BACKENDS as TRAINER_BACKENDS

    assert tuple(TRAINER_BACKENDS) == BACKENDS


def test_a_jsonl_file_without_the_fields_its_format_reads_is_a_problem_before_any_start(tmp_path):
    """A .jsonl without a text field passed init, validate, doctor and the scripts' --check; the trainer stopped at
    its first record, after the process group, and torchrun's failure block followed."""
    (tmp_path / "d.jsonl").write_text('{"body": "hello"}\n{"body": "again"}\n')
    config = "data:\n  type: files\n  paths: [d.jsonl]\n"
    (found,) = problems_of(write_yaml(tmp_path, config)).values()
    assert found.path == "data.paths[0]" and "first record has no field 'text' that format text reads" in found.message
    assert problems_of(write_yaml(tmp_path, config + "  text_field: body\n")) == {}
    (tmp_path / "d.jsonl").write_text('{"text": null}\n')  # the trainer reads a null as no field
    assert "no field 'text'" in next(iter(problems_of(write_yaml(tmp_path, config)).values())).message
    (tmp_path / "d.jsonl").write_text('{"prompt": "2+2=", "answer": "4"}\n')
    (found,) = problems_of(write_yaml(tmp_path, config + "  format: prompt_completion\n")).values()
    assert "no field 'completion' that format prompt_completion reads (its fields: prompt, answer)" in found.message
