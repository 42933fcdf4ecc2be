import dataclasses
import json

import pytest
from hostile_input import one_line_error

from distsetup.errors import DistsetupError
from distsetup.formats.fsdp import KEYS, RESHARDS_AFTER_FORWARD, SHARDING_STRATEGIES, FsdpSpec, build_fsdp_config
from distsetup.formats.fsdp_rules import check_fsdp_spec, fsdp_findings, fsdp_problems


def fsdp(run_cli, *args):
    result = run_cli("fsdp", *args)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_quick_start_writes_accelerate_keys(run_cli, tmp_path):
    out = tmp_path / "config" / "fsdp_config.json"
    result = run_cli("fsdp", "--sharding_strategy", "FULL_SHARD", "--mixed_precision", "BFLOAT16", "--output", out)
    assert result.exit_code == 0
    config = json.loads(out.read_text())
    assert config["fsdp_sharding_strategy"] == "FULL_SHARD"
    assert config["fsdp_reshard_after_forward"] is True
    assert config["mixed_precision"] == "bf16" and config["fsdp_reduce_dtype"] == "float32"
    assert config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert config["fsdp_transformer_layer_cls_to_wrap"] == "Block"
    assert all(k.startswith("fsdp_") or k == "mixed_precision" for k in config)
    assert fsdp_problems(config) == []
    # the built-in model's block, said: a Hugging Face model has none, and Accelerate stops on it
    assert "for a Hugging Face model give --transformer_layer_cls_to_wrap" in result.stderr
    named = run_cli("fsdp", "--transformer_layer_cls_to_wrap", "LlamaDecoderLayer", "--output", out)
    assert named.exit_code == 0 and "--transformer_layer_cls_to_wrap" not in named.stderr


@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
def test_every_strategy_validates_and_maps_to_reshard(run_cli, strategy):
    config = fsdp(run_cli, "--sharding-strategy", strategy)
    assert config["fsdp_reshard_after_forward"] is RESHARDS_AFTER_FORWARD[strategy]
    assert fsdp_problems(config) == []


def test_layer_classes_repeatable_or_comma_separated(run_cli):
    config = fsdp(
        run_cli,
        "--transformer_layer_cls_to_wrap",
        "LlamaDecoderLayer,MistralDecoderLayer",
        "--transformer-layer-cls-to-wrap",
        "Block",
    )
    assert config["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer,MistralDecoderLayer,Block"


def test_fsdp1_writes_its_own_knobs(run_cli):
    config = fsdp(
        run_cli,
        "--fsdp_version",
        "1",
        "--backward_prefetch",
        "BACKWARD_POST",
        "--forward_prefetch",
        "--mixed_precision",
        "FLOAT16",
        "--buffer_dtype",
        "float16",
        "--cpu_ram_efficient_loading",
    )
    assert config["fsdp_backward_prefetch"] == "BACKWARD_POST" and config["fsdp_forward_prefetch"] is True
    assert config["fsdp_buffer_dtype"] == "float16" and config["mixed_precision"] == "fp16"
    assert config["fsdp_sync_module_states"] is True  # Accelerate needs it with cpu_ram_efficient_loading
    # the HF Trainer's FSDP1 reads its sharding strategy here, Accelerate's from fsdp_sharding_strategy
    assert config["fsdp_reshard_after_forward"] == config["fsdp_sharding_strategy"] == "FULL_SHARD"
    assert fsdp_problems(config) == []


def test_size_based_wrap(run_cli):
    config = fsdp(run_cli, "--auto_wrap_policy", "SIZE_BASED_WRAP", "--min_num_params", "1000000", "--cpu_offload")
    assert config["fsdp_min_num_params"] == 1_000_000 and config["fsdp_offload_params"] is True
    assert "fsdp_transformer_layer_cls_to_wrap" not in config


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backward_prefetch", "BACKWARD_PRE"], "--backward_prefetch means nothing with --fsdp_version 2"),
        (["--use_orig_params"], "--use_orig_params means nothing with --fsdp_version 2"),
        (["--buffer_dtype", "float32", "--mixed_precision", "BFLOAT16"], "--buffer_dtype means nothing"),
        (["--auto_wrap_policy", "SIZE_BASED_WRAP"], "needs --min_num_params"),
        (["--auto_wrap_policy", "NO_WRAP", "--transformer_layer_cls_to_wrap", "Block"], "only used with TRANSFORMER"),
        (["--reduce_dtype", "bfloat16"], "means nothing without --mixed_precision"),
        (["--sharding_strategy", "ZERO3"], "--sharding_strategy"),
    ],
)
def test_options_meaningless_together_are_errors(run_cli, tmp_path, args, message):
    out = tmp_path / "fsdp.json"
    result = run_cli("fsdp", *args, "-o", out)
    assert result.exit_code != 0 and message in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("strategy", ["NO_SHARD", "HYBRID_SHARD"])
def test_fsdp2_strategies_accelerate_reads_differently_are_flagged(run_cli, strategy):
    result = run_cli("fsdp", "--sharding_strategy", strategy)
    assert result.exit_code == 0 and "Warning:" in result.stderr and "Accelerate" in result.stderr
    assert "Warning" not in run_cli("fsdp", "--sharding_strategy", "FULL_SHARD").stderr


SPECS = [
    FsdpSpec(transformer_layer_cls_to_wrap=("Block",)),
    FsdpSpec(
        transformer_layer_cls_to_wrap=("Block", "Embedding"),
        sharding_strategy="SHARD_GRAD_OP",
        mixed_precision="BFLOAT16",
        reduce_dtype="bfloat16",
        cpu_offload=True,
    ),
    FsdpSpec(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=1000, state_dict_type="FULL_STATE_DICT"),
    FsdpSpec(
        fsdp_version=1,
        auto_wrap_policy="NO_WRAP",
        backward_prefetch="BACKWARD_POST",
        buffer_dtype="float16",
        mixed_precision="FLOAT16",
        cpu_ram_efficient_loading=True,
    ),
]


@pytest.mark.parametrize("spec", SPECS)
def test_a_written_file_reads_back_as_the_spec_it_was_written_from(spec):
    """FsdpSpec is the file's one model: written, read back (as the trainer and doctor read it), written again."""
    config = build_fsdp_config(spec)
    assert fsdp_problems(config) == []
    read = FsdpSpec.from_dict(config)
    assert build_fsdp_config(read) == config
    assert read.precision == {"no": "fp32", "FLOAT16": "fp16", "BFLOAT16": "bf16"}[spec.mixed_precision]
    assert read.reshards_after_forward == RESHARDS_AFTER_FORWARD[spec.sharding_strategy]


@pytest.mark.parametrize(
    "changes, option",
    [
        ({"fsdp_version": 2, "use_orig_params": True}, "use_orig_params"),
        ({"auto_wrap_policy": "SIZE_BASED_WRAP"}, "min_num_params"),
        ({"auto_wrap_policy": "NO_WRAP", "min_num_params": 10}, "min_num_params"),
        ({"reduce_dtype": "float32"}, "reduce_dtype"),
        ({"fsdp_version": 1, "cpu_ram_efficient_loading": True, "sync_module_states": False}, "sync_module_states"),
    ],
)
def test_the_rules_are_one_rule_for_flags_and_files(changes, option):
    """What `distsetup fsdp` refuses in flags, `validate` reports in a file's keys, from the same rule: as a
    problem, or as a note where the setting is only unused (no reader refuses it)."""
    spec = FsdpSpec(**{"transformer_layer_cls_to_wrap": ("Block",), **changes})
    if changes.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP") != "TRANSFORMER_BASED_WRAP":
        spec = dataclasses.replace(spec, transformer_layer_cls_to_wrap=())
    with pytest.raises(DistsetupError, match=f"--{option}"):
        check_fsdp_spec(spec)
    config = {**build_fsdp_config(dataclasses.replace(spec, **{option: None})), **_file_values(spec, option)}
    problems, notes = fsdp_findings(config)
    unused = changes.get("auto_wrap_policy") == "NO_WRAP"
    assert (KEYS[option] in [p.path for p in problems]) != unused
    assert any(note.startswith(f"{KEYS[option]} is only used with") for note in notes) == unused


def test_a_layer_class_that_is_no_class_name_is_refused_in_flags_and_files(run_cli):
    """'Llama Decoder' was written and passed validate; the trainer and Accelerate look each name up as a class."""
    one_line_error(run_cli("fsdp", "--transformer_layer_cls_to_wrap", "Llama Decoder", "-o", "-"), "not a class name")
    config = {"fsdp_version": 2, "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer,Llama Decoder"}
    problems, _ = fsdp_findings(config)
    assert [p.path for p in problems] == ["fsdp_transformer_layer_cls_to_wrap"]
    assert "'Llama Decoder' is not a class name" in problems[0].message


def _file_values(spec: FsdpSpec, option: str) -> dict:
    """The file's key and value for `option` of `spec` (the one build_fsdp_config may leave out)."""
    value = getattr(spec, option)
    return {} if value is None else {KEYS[option]: value}


def test_the_spellings_accelerate_and_the_hf_trainer_read_mean_the_same(run_cli, tmp_path):
    """An FSDP file as the HF Trainer's fsdp_config spells it (keys without fsdp_, lower-case names but the wrapping
    policy's, which it takes upper-case only, the classes to wrap as a list) and with Accelerate's numbered sharding
    strategy: no problem, a note for the spellings, and the spec distsetup's own spelling gives (the trainer reads
    it so too)."""
    canonical = {
        "fsdp_version": 1,
        "fsdp_sharding_strategy": "SHARD_GRAD_OP",
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "A,B",
        "fsdp_backward_prefetch": "BACKWARD_PRE",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    }
    other = {
        "fsdp_version": 1,
        "fsdp_sharding_strategy": 2,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": ["A", "B"],
        "backward_prefetch": "backward_pre",
        "state_dict_type": "sharded_state_dict",
    }
    assert FsdpSpec.from_dict(other) == FsdpSpec.from_dict(canonical)
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(other))
    result = run_cli("validate", path)
    assert result.exit_code == 0 and "FSDP config, no problems" in result.stdout, result.output
    assert "2 is read as 'SHARD_GRAD_OP'" in result.stdout + result.stderr


def test_an_fsdp2_file_says_its_sharding_with_reshard_after_forward_as_accelerate_writes_it(run_cli, tmp_path):
    """Accelerate's FSDP2 config has no sharding strategy: fsdp_reshard_after_forward says it."""
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"fsdp_version": 2, "fsdp_reshard_after_forward": False}))
    assert run_cli("validate", path).exit_code == 0
    assert FsdpSpec.from_dict(json.loads(path.read_text())).sharding_strategy == "SHARD_GRAD_OP"


@pytest.mark.parametrize("command, flag", [("fsdp", "--fsdp_config"), ("deepspeed", "--deepspeed_config")])
def test_the_next_step_quotes_the_file_it_names(run_cli, tmp_path, monkeypatch, command, flag):
    """The "Next:" line is a command to paste: a file name with a space or a $ is quoted in it."""
    monkeypatch.chdir(tmp_path)
    args = ["--zero_stage", 2] if command == "deepspeed" else []
    result = run_cli(command, *args, "-o", "my run$1.json")
    assert result.exit_code == 0 and f"{flag} 'my run$1.json'" in result.stderr, result.stderr
