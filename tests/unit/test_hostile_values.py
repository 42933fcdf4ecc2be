"""Hostile values: every option of every command refuses NaN, infinities and empty values, counts have sane maxima,
plan's numbers are checked and contradictions refused; each in one line naming the flag or key, with no traceback
and nothing written over, or reported as a problem with its key path."""

import json

import click
import pytest
from hostile_input import fenced_cli, one_line_error, problems_of
from launch_inputs import DS_CONFIG

from distsetup.cli.main import COMMANDS, cli
from distsetup.cli.options import Checked
from distsetup.cli.output import json_text
from distsetup.errors import DistsetupError
from distsetup.formats.runconfig_load import load_run_config
from distsetup.scripts.launch_plan import LaunchSpec, launch_context

# --- every option of every command refuses NaN, infinities and empty values --------------------------


def every_parameter():
    for name in sorted(COMMANDS):
        for param in cli.get_command(None, name).params:
            if not (isinstance(param, click.Option) and param.is_flag):
                yield name, param


@pytest.mark.parametrize("name, param", list(every_parameter()), ids=lambda v: getattr(v, "name", v))
def test_every_valued_parameter_refuses_empty_text_and_non_finite_numbers(name, param):
    assert isinstance(param.type, Checked), f"{name} {param.name} bypasses options.option()"
    with pytest.raises(DistsetupError, match="is empty"):
        param.type.convert("", param, None)
    for bad in ("nan", "inf", "-inf", "1e400"):
        try:
            value = param.type.convert((bad,) * param.type.arity if param.type.arity > 1 else bad, param, None)
        except (DistsetupError, click.UsageError):  # distsetup's refusal, or Click's (a usage error)
            continue
        assert not any(isinstance(v, float) for v in (value if isinstance(value, tuple) else (value,))), (
            f"{name} {param.name} took {bad}"
        )


@pytest.mark.parametrize(
    "flag, value", [("--lr", "nan"), ("--eps", "1e400"), ("--gradient_clipping", "inf"), ("--weight_decay", "nan")]
)
def test_deepspeed_refuses_non_finite_floats_and_keeps_the_good_file(run_cli, here, flag, value):
    one_line_error(run_cli("deepspeed", flag, value, "-o", "good.json"), flag, "not a finite number")
    assert json.loads((here / "good.json").read_text()) == DS_CONFIG


def test_betas_are_finite_too(run_cli):
    one_line_error(run_cli("deepspeed", "--betas", "0.9", "nan"), "--betas", "not a finite number")


def test_json_is_written_strictly():
    with pytest.raises(DistsetupError, match="not a finite number"):
        json_text({"lr": float("nan")})
    assert json_text({"lr": 1e-3}) == '{\n  "lr": 0.001\n}\n'


@pytest.mark.parametrize(
    "literal, path",
    [
        ("NaN", "train_micro_batch_size_per_gpu"),
        ("Infinity", "gradient_clipping"),
        ("-Infinity", "gradient_clipping"),
        ("1e400", "gradient_clipping"),
    ],
)
def test_validate_reports_nan_and_infinity_in_json_with_their_path(run_cli, tmp_path, literal, path):
    config = {**DS_CONFIG, path: "X"}
    (tmp_path / "ds.json").write_text(json.dumps(config).replace('"X"', literal))
    found = problems_of(tmp_path / "ds.json")
    assert "not a finite number" in found[path].message
    assert run_cli("validate", tmp_path / "ds.json").exit_code == 1


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", ".NaN", "1e400"])
def test_run_config_with_inf_or_nan_is_refused_everywhere(run_cli, here, value):
    (here / "config.yaml").write_text(f"training:\n  lr: {value}\n")
    assert "not a finite number" in problems_of(here / "config.yaml")["training.lr"].message
    with pytest.raises(DistsetupError, match="training.lr: .* is not a finite number"):
        load_run_config(here / "config.yaml")  # what src/train.py calls
    one_line_error(run_cli("launcher", "--config", "config.yaml", "-o", "-"), "training.lr", "not a finite number")
    doctor = run_cli("doctor", "--config", "config.yaml", "--json")
    assert doctor.exit_code == 1 and any("not a finite number" in f["message"] for f in json.loads(doctor.stdout))


@pytest.mark.parametrize(
    "args, flag",
    [
        (["launcher", "--config", ""], "--config"),
        (["launcher", "--script", ""], "--script"),
        (["launcher", "--gpus", ""], "--gpus"),
        (["launcher", "--master_addr", "", "--num_nodes", "2"], "--master_addr"),
        (["slurm", "--job_name", ""], "--job_name"),
        (["slurm", "--config", " "], "--config"),
        (["deepspeed", "-o", ""], "--output"),
        (["plan", "--params", "7B", "--gpu_memory", "80GB", "--write", ""], "--write"),
        (["doctor", "--config", ""], "--config"),
        (["validate", ""], "FILE"),
        (["checkpoint", "export", "runs", "-o", ""], "--output"),  # said ". exists", the folder it read "" as
        (["checkpoint", "convert", "runs", "--to", "ddp", "-o", " "], "--output"),
        (["checkpoint", "ls", ""], "RUN"),
    ],
)
def test_empty_values_are_refused_not_taken_as_not_given(run_cli, here, args, flag):
    line = one_line_error(run_cli(*args), f"{flag} is empty")
    assert not (here / "scripts").exists()
    required = flag in ("FILE", "RUN") or args[0] == "checkpoint"
    assert line.endswith("HINT: give a value.") == required  # not "or leave it out"


@pytest.mark.parametrize("value", ['""', '"   "'])
def test_blank_output_dir_is_a_run_config_problem(tmp_path, value):
    (tmp_path / "config.yaml").write_text(f"training:\n  output_dir: {value}\n")
    assert "is empty" in problems_of(tmp_path / "config.yaml")["training.output_dir"].message


# --- counts with sane maxima; plan's numbers ---------------------------------------------------------


def test_huge_node_count_is_refused_at_once(run_cli):
    result = fenced_cli(
        "launcher", "--num_nodes", "99999999999999999999", "--master_addr", "10.0.0.1", "--node_rank", "0", "-o", "-"
    )  # was: a host list of 10^20 entries (hang, gigabytes)
    assert result.returncode == 1 and "--num_nodes 99999999999999999999 is more than 100,000" in result.stderr
    one_line_error(
        run_cli("slurm", "--num_nodes", "2", "--num_gpus_per_node", "4096", "-o", "-"),
        "--num_gpus_per_node 4096 is more than 1,024",
    )
    one_line_error(
        run_cli("validate", "config/config.yaml", "--num_nodes", "10000000", "--num_gpus_per_node", "8"),
        "--num_nodes 10000000",
    )


def test_only_the_deepspeed_launcher_lists_the_nodes():
    assert launch_context(LaunchSpec(num_nodes=100_000, nproc_per_node=8, master_addr="h"))["hosts"] == []
    hosts = launch_context(LaunchSpec(num_nodes=3, nproc_per_node=8, master_addr="h", launch_method="deepspeed"))
    assert hosts["hosts"] == ["node0", "node1", "node2"]


PLAN = {"--params": "7B", "--gpu_memory": "80GB", "--num_gpus": "8"}


@pytest.mark.parametrize(
    "args, words",
    [
        (["--params", "0"], "--params 0 is 0 parameters"),  # was ZeroDivisionError
        (["--params", "1e400"], "--params: cannot read '1e400'"),
        (["--params", "1.2.3B"], "--params: cannot read"),
        (["--gpu_memory", "0GB"], "--gpu_memory 0GB is no memory at all"),
        (["--gpu_memory", "9" * 400 + "GB"], "--gpu_memory: cannot read"),
        (["--cpu_memory", "0"], "--cpu_memory 0 is no memory at all"),
        (["--bf16", "--fp16"], "--bf16 and --fp16 are mutually exclusive"),
        (["--fp16", "--fp32"], "--fp16 and --fp32 are mutually exclusive"),
        (["--hidden_size", "100", "--num_heads", "3"], "--hidden_size 100 is not divisible by --num_heads 3"),
        (["--hidden_size", "10000000"], "--hidden_size"),
        (["--global_batch_size", "9" * 30], "--global_batch_size"),
        (["--num_gpus", "9" * 20], "more than 1,024"),
        (["--headroom", "nan"], "--headroom"),
    ],
)
def test_plan_numbers_are_checked(run_cli, args, words):
    defaults = [x for flag, value in PLAN.items() if flag not in args for x in (flag, value)]
    one_line_error(run_cli("plan", *args, *defaults), words)


# --- contradictions --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["--scheduler", "WarmupDecayLR", "--warmup_num_steps", "1000", "--total_num_steps", "10"],
            "--warmup_num_steps 1000 is not shorter than --total_num_steps 10",
        ),
        (["--scheduler", "WarmupCosineLR", "--warmup_num_steps", "10", "--total_num_steps", "10"], "not shorter"),
        (["--scheduler", "WarmupCosineLR", "--total_num_steps", "50"], "the default --warmup_num_steps 100"),
        (
            ["--micro_batch_size", "4", "--gradient_accumulation_steps", "4", "--train_batch_size", "15"],
            "15 is not a multiple of --micro_batch_size 4 x --gradient_accumulation_steps 4 = 16",
        ),
    ],
)
def test_deepspeed_contradictions(run_cli, args, words):
    one_line_error(run_cli("deepspeed", *args), words)


def test_a_deepspeed_file_warming_up_longer_than_its_run(tmp_path):
    config = {
        **DS_CONFIG,
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 1000, "total_num_steps": 10}},
    }
    (tmp_path / "ds.json").write_text(json.dumps(config))
    assert (
        "warmup would take the whole run"
        in problems_of(tmp_path / "ds.json")["scheduler.params.warmup_num_steps"].message
    )


def test_fsdp_file_values_of_the_wrong_kind(run_cli, here):
    (here / "fsdp.json").write_text(
        json.dumps(
            {
                "fsdp_version": 2,
                "fsdp_sharding_strategy": "FULL_SHARD",
                "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                "fsdp_min_num_params": -7,
                "fsdp_offload_params": "yes",
            }
        )
    )
    found = problems_of(here / "fsdp.json")
    assert "out of range" in found["fsdp_min_num_params"].message
    assert "wrong type" in found["fsdp_offload_params"].message
    one_line_error(
        run_cli("launcher", "--use_fsdp", "--fsdp_config", "fsdp.json", "-o", "-"),
        "fsdp_min_num_params",
        "`distsetup validate fsdp.json` lists every problem",
    )


@pytest.mark.parametrize(
    "args, flag", [(["--allow_fewer"], "--allow_fewer"), (["--global_batch_size", "64"], "--global_batch_size")]
)
def test_status_options_that_need_count(run_cli, args, flag):
    one_line_error(run_cli("status", *args), f"{flag} works with --count")
