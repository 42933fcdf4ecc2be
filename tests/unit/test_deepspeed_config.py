"""`distsetup deepspeed`: the output is what DeepSpeed's own DeepSpeedConfig accepts, for any flags."""

import itertools
import json
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from repo import REPO

from distsetup.errors import DistsetupError
from distsetup.formats.accelerate import accelerate_problems
from distsetup.formats.batch import BatchMismatch
from distsetup.formats.deepspeed import PRESETS, STAGES, DeepSpeedSpec, batch_of
from distsetup.formats.deepspeed_rules import auto_paths, check_spec, deepspeed_problems
from distsetup.formats.fast_schema import conforms
from distsetup.formats.problems import load_schema

deepspeed_runtime_config = pytest.importorskip("deepspeed.runtime.config")


def deepspeed_accepts(config: dict, world_size: int = 1):
    """Parse `config` with DeepSpeed's DeepSpeedConfig as if `world_size` ranks had started; a file without batch
    keys as distsetup's trainer hands it over, with the run config's batch (here micro-batch 1)."""
    if not {"train_batch_size", "train_micro_batch_size_per_gpu"} & set(config):
        config = {**config, "train_micro_batch_size_per_gpu": 1}
    dist = deepspeed_runtime_config.dist
    with (
        mock.patch.object(dist, "get_rank", return_value=0),
        mock.patch.object(dist, "get_world_size", return_value=world_size),
    ):
        return deepspeed_runtime_config.DeepSpeedConfig(config)


def invoke(run_cli, *args):
    result = run_cli("deepspeed", *args)
    return result, (json.loads(result.stdout) if result.exit_code == 0 else None)


@pytest.mark.parametrize("world", [2, 4])
def test_the_train_batch_alone_is_split_as_deepspeed_splits_it(run_cli, world):
    """DeepSpeed reads a file of train_batch_size alone as an accumulation of 1, each process's share its micro-batch
    (DeepSpeedConfig._set_batch_related_parameters); distsetup wrote micro 1 x accumulation 6 for 12 over 2."""
    result, config = invoke(run_cli, "--zero_stage", "2", "--train_batch_size", "12", "--world_size", str(world))
    assert result.exit_code == 0, result.output
    alone = deepspeed_accepts({"train_batch_size": 12}, world)
    assert config["train_micro_batch_size_per_gpu"] == alone.train_micro_batch_size_per_gpu == 12 // world
    assert config["gradient_accumulation_steps"] == alone.gradient_accumulation_steps == 1


@st.composite
def flag_lists(draw):
    """`distsetup deepspeed` flags: mostly consistent for the drawn stage, sometimes deliberately not."""
    pick = lambda *options: list(draw(st.sampled_from(options)))  # noqa: E731
    stage = draw(st.integers(0, 3))
    sloppy = draw(st.integers(0, 4)) == 0  # one draw in five may break a cross-field rule
    flags = pick((), ("--preset", "zero1"), ("--preset", "zero2_offload"), ("--preset", "zero3_offload"))
    flags += [draw(st.sampled_from(["--zero_stage", "--zero-stage"])), str(stage)]
    device = draw(st.sampled_from(["cpu", "nvme"]))
    if stage >= 1 or sloppy:
        flags += pick((), ("--offload_optimizer",), ("--offload-optimizer", device))
    if stage == 3 or sloppy:
        flags += pick((), ("--offload_param",), ("--offload_param", device))
        flags += pick(
            (),
            ("--stage3_prefetch_bucket_size", "1000"),
            ("--stage3_max_live_parameters", "100000"),
            ("--stage3_max_reuse_distance", "100000"),
            ("--sub_group_size", "100000"),
            ("--stage3_gather_16bit_weights_on_model_save",),
            ("--stage3_param_persistence_threshold", "0"),
        )
    if "nvme" in flags and not sloppy:
        flags += ["--nvme_path", "/local/nvme"]
    flags += pick((), ("--no_pin_memory",), ("--pin-memory",))
    flags += pick((), ("--bf16",), ("--fp16",), *([("--bf16", "--fp16")] if sloppy else []))
    world = draw(st.sampled_from([None, 1, 4, 8]))
    if world == 8:
        flags += ["--num_nodes", "2", "--num_gpus_per_node", "4"]
    elif world:
        flags += ["--world_size", str(world)]
    batch = [
        ("--micro_batch_size", draw(st.sampled_from([1, 3, 4]))),
        ("--gradient_accumulation_steps", draw(st.sampled_from([1, 2, 8]))),
        ("--train_batch_size", draw(st.sampled_from([8, 24, 64]))),
    ]
    for flag, value in draw(st.lists(st.sampled_from(batch), max_size=3 if world or sloppy else 2, unique=True)):
        flags += [flag, str(value)]
    flags += pick(
        (),
        ("--gradient_clipping", "0.5"),
        ("--overlap_comm",),
        ("--no-contiguous-gradients",),
        ("--reduce_bucket_size", "200000000"),
        ("--allgather_bucket_size", "100000"),
    )
    flags += pick((), ("--optimizer", "none"), ("--optimizer", "Adam"), ("--lr", "1e-4", "--betas", "0.9", "0.95"))
    flags += pick(
        (),
        ("--scheduler", "WarmupLR"),
        ("--scheduler", "WarmupDecayLR", "--total_num_steps", "1000"),
        ("--scheduler", "WarmupCosineLR", "--total_num_steps", "500"),
        *([("--scheduler", "WarmupDecayLR")] if sloppy else []),
    )
    flags += pick((), ("--steps_per_print", "10"), ("--wall_clock_breakdown",))
    return flags, world or 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=flag_lists())
def test_every_flag_combination_is_rejected_clearly_or_accepted_by_deepspeed(run_cli, case):
    flags, world = case
    result, config = invoke(run_cli, *flags)
    if result.exit_code != 0:
        assert result.exit_code == 1 and result.stderr.startswith("Error: ") and "HINT:" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        return
    ds = deepspeed_accepts(config, world)
    assert deepspeed_problems(config, world) == []
    batch_flags = {"--micro_batch_size", "--gradient_accumulation_steps", "--train_batch_size"}
    written = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"} & set(config)
    assert bool(written) == bool(batch_flags & set(flags))  # no batch flag, no batch nobody chose
    assert conforms(config, load_schema("deepspeed"))  # every file written takes the fast path
    assert not auto_paths(config)
    stage = config["zero_optimization"]["stage"]
    assert ds.zero_optimization_stage == stage
    assert ds.train_batch_size == ds.train_micro_batch_size_per_gpu * ds.gradient_accumulation_steps * world
    for block in ("offload_optimizer", "offload_param"):
        if block in config["zero_optimization"]:
            assert isinstance(config["zero_optimization"][block]["pin_memory"], bool)
    assert not (ds.float16_config.enabled and ds.bfloat16_config.enabled)
    assert ds.float16_config.enabled == ("--fp16" in flags)


def test_fp16_at_zero_stage_0_which_deepspeed_does_not_loss_scale_is_refused(run_cli):
    result, config = invoke(run_cli, "--fp16")  # stage 0 is the default
    assert result.exit_code == 1 and config is None
    assert "--fp16 at --zero_stage 0" in result.stderr and "HINT: set --zero_stage to 1" in result.stderr


def test_zero2_offload_bf16_from_the_quick_start(run_cli):
    _, config = invoke(run_cli, "--zero_stage", "2", "--offload_optimizer", "--bf16")
    ds = deepspeed_accepts(config)
    assert ds.zero_optimization_stage == 2 and ds.bfloat16_config.enabled and not ds.float16_config.enabled
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


def test_fp16_gets_dynamic_loss_scaling(run_cli):
    _, config = invoke(run_cli, "--fp16", "--zero_stage", "1")
    ds = deepspeed_accepts(config)
    assert ds.float16_config.enabled and ds.float16_config.loss_scale == 0  # 0 = dynamic loss scaling
    assert ds.float16_config.initial_scale_power == config["fp16"]["initial_scale_power"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--zero_stage", "2", "--offload_param"], "--offload_param means nothing at --zero_stage 2"),
        (["--zero_stage", "3", "--offload_param", "nvme"], "--nvme_path"),
        (["--bf16", "--fp16"], "mutually exclusive"),
        (["--zero_stage", "1", "--stage3_max_live_parameters", "10"], "--stage3_max_live_parameters means nothing"),
        (["--zero_stage", "0", "--overlap_comm"], "--overlap_comm means nothing at --zero_stage 0"),
        # ZeRO-Offload is stage 2 with the optimizer on the CPU: the stage suggested where 1-3 all take it
        (["--zero_stage", "0", "--offload_optimizer", "cpu"], "set --zero_stage to 2"),
        (["--zero_stage", "0", "--reduce_bucket_size", "100"], "--reduce_bucket_size means nothing"),
        (["--zero_stage", "3", "--allgather_bucket_size", "100"], "at stages 1, 2 only"),
        (["--betas", "1.5", "2"], "each beta must be in [0, 1)"),
        (["--optimizer", "none", "--scheduler", "WarmupLR"], "needs --lr"),
        (
            ["--hf_auto", "--lr", "1e-4", "--scale_lr", "linear", "--base_batch_size", "1", "--world_size", "2"],
            "--scale_lr cannot be combined with --hf_auto",
        ),
        (
            [
                "--micro_batch_size",
                "4",
                "--gradient_accumulation_steps",
                "2",
                "--train_batch_size",
                "30",
                "--world_size",
                "4",
            ],
            "--train_batch_size 30 != --micro_batch_size 4",
        ),
        (["--zero_stage", "7"], "--zero_stage"),
    ],
)
def test_bad_flags_name_the_flag_and_write_nothing(run_cli, tmp_path, args, message):
    out = tmp_path / "ds.json"
    result = run_cli("deepspeed", *args, "--output", out)
    assert result.exit_code != 0
    assert message in result.stderr
    assert not out.exists()


def test_nvme_at_stage_2_warns_that_states_stay_in_cpu_memory(run_cli, tmp_path):
    """Said when the file is written, and again when validate reads it (it said nothing)."""
    result, config = invoke(run_cli, "--zero_stage", "2", "--offload_optimizer", "nvme", "--nvme_path", "/nvme")
    assert "keeps optimizer states in CPU memory" in result.stderr
    deepspeed_accepts(config)
    for stage, said in ((2, True), (3, False)):
        (tmp_path / "ds.json").write_text(
            json.dumps({**config, "zero_optimization": {**config["zero_optimization"], "stage": stage}})
        )
        validated = run_cli("validate", tmp_path / "ds.json")
        assert validated.exit_code == 0 and ("keeps optimizer states in CPU memory" in validated.output) == said


def test_world_size_makes_the_batch_explicit(run_cli):
    _, config = invoke(
        run_cli,
        "--micro_batch_size",
        "4",
        "--num_nodes",
        "2",
        "--num_gpus_per_node",
        "8",
        "--gradient_accumulation_steps",
        "2",
    )
    assert config["train_batch_size"] == 4 * 2 * 16
    assert deepspeed_accepts(config, 16).train_batch_size == 128


def test_preset_is_overridden_by_explicit_flags(run_cli):
    _, config = invoke(run_cli, "--preset", "zero3_offload", "--zero_stage", "3", "--no_pin_memory", "--overlap_comm")
    zero = config["zero_optimization"]
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": False}
    _, plain = invoke(run_cli, "--preset", "zero2", "--no-overlap-comm")
    assert plain["zero_optimization"]["overlap_comm"] is False


@pytest.mark.parametrize("preset, stage", [("zero3", "2"), ("zero3_offload", "1"), ("zero2_offload", "0")])
def test_preset_values_give_way_to_a_lower_stage(run_cli, preset, stage):
    result, config = invoke(run_cli, "--preset", preset, "--zero_stage", stage)
    assert result.exit_code == 0, result.stderr
    zero = config["zero_optimization"]
    assert zero["stage"] == int(stage)
    assert not any(k.startswith("stage3_") or k == "offload_param" for k in zero)
    assert ("offload_optimizer" in zero) == (preset.endswith("offload") and stage != "0")
    assert deepspeed_problems(config) == []


def test_adam_is_plain_adam_and_warmup_is_linear(run_cli):
    _, config = invoke(run_cli, "--optimizer", "Adam", "--scheduler", "WarmupLR", "--warmup_min_lr", "1e-6")
    assert config["optimizer"]["params"]["adam_w_mode"] is False
    assert config["scheduler"]["params"]["warmup_type"] == "linear"
    assert config["scheduler"]["params"]["warmup_min_lr"] == 1e-6
    deepspeed_accepts(config)


def test_hf_auto_points_at_the_trainer_not_the_launcher(run_cli, tmp_path):
    result = run_cli("deepspeed", "--hf_auto", "-o", tmp_path / "ds.json")
    assert "TrainingArguments(deepspeed=" in result.stderr and "distsetup launcher" not in result.stderr


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_checked_in_presets_match_the_builder(run_cli, name):
    """config/presets/*.json are generated (`make presets`); they must not drift from the code."""
    _, config = invoke(run_cli, "--preset", name)
    assert json.loads((REPO / "config" / "presets" / f"{name}.json").read_text()) == config
    deepspeed_accepts(config)


@pytest.mark.parametrize(
    "args",
    [
        ["--zero_stage", "3", "--hf_auto", "--scheduler", "WarmupDecayLR"],
        ["--zero_stage", "2", "--hf_auto", "--micro_batch_size", "2", "--bf16"],
        ["--zero_stage", "1", "--hf_auto", "--scheduler", "WarmupCosineLR", "--optimizer", "none"],
    ],
)
def test_hf_auto_values_are_exactly_the_ones_the_hf_trainer_fills(run_cli, tmp_path, args):
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    _, config = invoke(run_cli, *args)
    assert auto_paths(config), "--hf_auto wrote no auto value"
    assert deepspeed_problems(config, hf=True) == []
    assert any("auto" in p.message for p in deepspeed_problems(config, hf=False))
    training_args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
        learning_rate=1e-4,
        bf16="--bf16" in args,
        report_to=[],
        use_cpu=True,
    )
    hf = HfTrainerDeepSpeedConfig(config)
    hf.trainer_config_process(training_args)
    model = mock.Mock(config=mock.Mock(hidden_size=64, hidden_sizes=None))
    hf.trainer_config_finalize(training_args, model, num_training_steps=100)
    assert not auto_paths(hf.config), f"HF left auto at {auto_paths(hf.config)}"
    understood = deepspeed_accepts(hf.config)
    assert understood.train_micro_batch_size_per_gpu == 2
    # at ZeRO-3 the Trainer saves weights only where DeepSpeed gathers them (else no model file)
    assert understood.zero_config.gather_16bit_weights_on_model_save == (understood.zero_optimization_stage == 3)


def test_zero3_gathers_16bit_weights_on_save_unless_told_not_to(run_cli):
    """`--zero_stage 3` turns it on, as the zero3 preset does: without it the HF Trainer and DeepSpeed's
    save_16bit_model save no weights."""
    for args, gathered in (((), True), (("--no_stage3_gather_16bit_weights_on_model_save",), False)):
        _, config = invoke(run_cli, "--zero_stage", "3", *args)
        assert deepspeed_accepts(config).zero_config.gather_16bit_weights_on_model_save is gathered


def test_without_hf_auto_no_value_is_auto(run_cli):
    _, config = invoke(run_cli, "--zero_stage", "3", "--scheduler", "WarmupLR")
    assert auto_paths(config) == []


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_batch_identity_is_deepspeeds_own(world_size):
    """complete_batch (the trainer, `validate --world_size`) derives what DeepSpeed derives from a file, and
    refuses exactly the files DeepSpeed refuses."""
    values = (None, 1, 2, 3, 4, 6, 12)
    outcomes = set()
    for micro, accumulation, train in itertools.product(values, values, values):
        if micro is None and train is None:
            continue  # the schema's problem, before any arithmetic
        config = {
            key: value
            for key, value in (
                ("train_micro_batch_size_per_gpu", micro),
                ("gradient_accumulation_steps", accumulation),
                ("train_batch_size", train),
            )
            if value is not None
        }
        try:
            theirs = deepspeed_accepts(config, world_size)
        except (AssertionError, ValueError):
            with pytest.raises(BatchMismatch):
                batch_of(config, world_size)
            outcomes.add("refused")
            continue
        outcomes.add("accepted")
        ours = batch_of(config, world_size)
        assert (ours.micro, ours.accumulation, ours.train_batch) == (
            theirs.train_micro_batch_size_per_gpu,
            theirs.gradient_accumulation_steps,
            theirs.train_batch_size,
        ), config
    assert outcomes == {"accepted", "refused"}


@pytest.mark.parametrize("option", sorted(STAGES))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_rules_are_one_rule_for_flags_and_files(option, stage):
    """`distsetup deepspeed` refuses an option at a ZeRO stage exactly where `validate` flags it in a file."""
    value = {"offload_optimizer": "cpu", "offload_param": "cpu"}.get(option, True if "comm" in option else 1000)
    if option.startswith("stage3_gather") or option == "contiguous_gradients":
        value = True
    try:
        check_spec(DeepSpeedSpec(zero_stage=stage, **{option: value}))
        refused = False
    except DistsetupError:
        refused = True
    in_file = {"device": value} if option.startswith("offload_") else value
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage, option: in_file}}
    flagged = [p.path for p in deepspeed_problems(config)] == [f"zero_optimization.{option}"]
    assert refused == flagged == (stage not in STAGES[option])


@pytest.mark.parametrize(
    "spec, flag, key, accelerate_key",
    [
        (DeepSpeedSpec(zero_stage=0, precision="fp16"), "--fp16", "fp16.enabled", "mixed_precision"),
        (
            DeepSpeedSpec(zero_stage=2, offload_param="cpu"),
            "--offload_param",
            "zero_optimization.offload_param",
            "deepspeed_config.offload_param_device",
        ),
        (
            DeepSpeedSpec(zero_stage=3, offload_optimizer="nvme"),
            "--nvme_path",
            "zero_optimization.offload_optimizer.nvme_path",
            "deepspeed_config.offload_optimizer_nvme_path",
        ),
    ],
)
def test_the_deepspeed_rules_are_one_rule_for_flags_files_and_accelerate(spec, flag, key, accelerate_key):
    """What `distsetup deepspeed` refuses in flags, `validate` reports in a DeepSpeed file's keys and in an Accelerate
    config's deepspeed_config block, from the same violation."""
    with pytest.raises(DistsetupError, match=flag):
        check_spec(spec)
    assert key in [p.path for p in deepspeed_problems(spec.to_dict())]
    block = {"zero_stage": spec.zero_stage}
    block.update({f"{o}_device": getattr(spec, o) for o in ("offload_optimizer", "offload_param") if getattr(spec, o)})
    precision = {"fp16": "fp16", "bf16": "bf16"}.get(spec.precision, "no")
    found = accelerate_problems(
        {"distributed_type": "DEEPSPEED", "deepspeed_config": block, "mixed_precision": precision}
    )
    assert accelerate_key in [p.path for p in found]
