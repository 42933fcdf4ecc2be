"""Issue 10, the hostile-input campaign: every case is refused in one line naming the flag or key, fast, with
no traceback and nothing written over, or reported as a problem with its key path."""

import json
import os
import resource
import subprocess
import sys
import time

import click
import pytest
from launch_inputs import DS_CONFIG
from shell_checks import fake_tools, run_script

from distsetup.cli.main import COMMANDS, cli
from distsetup.cli.options import Checked
from distsetup.cli.output import json_text, write_atomic
from distsetup.errors import DistsetupError
from distsetup.formats.reading import MAX_CONFIG_BYTES, MAX_DEPTH, parse_yaml, read_yaml
from distsetup.formats.runconfig import load_run_config
from distsetup.formats.validate import validate_file
from distsetup.scripts.launch_plan import LaunchSpec, launch_context
from distsetup.scripts.sbatch import SlurmSpec, build_slurm_script
from tests.conftest import REPO

RUN_CONFIG = "training: {micro_batch_size: 4}\ndistributed: {backend: ddp}\n"


def one_line_error(result, *words):
    """Exit 1 with a single `Error: ...` line on stderr that holds every one of `words`."""
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in result.output, result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def problems_of(path, **kwargs) -> dict:
    return {p.path: p for p in validate_file(path, **kwargs)[1]}


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A folder with a run config and a good DeepSpeed file; the cwd."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text(RUN_CONFIG)
    (tmp_path / "good.json").write_text(json.dumps(DS_CONFIG))
    return tmp_path


# --- 3: no command writes over one of its own inputs -------------------------------------------------


@pytest.mark.parametrize(
    "args, victim, what",
    [
        (["launcher", "--config", "config.yaml", "-o", "config.yaml"], "config.yaml", "run config"),
        (["slurm", "--config", "config.yaml", "-o", "config.yaml"], "config.yaml", "run config"),
        (
            ["launcher", "--deepspeed_config", "good.json", "--num_gpus_per_node", "2", "-o", "good.json"],
            "good.json",
            "DeepSpeed config",
        ),
        (
            ["slurm", "--deepspeed_config", "good.json", "--num_gpus_per_node", "2", "-o", "./sub/../good.json"],
            "good.json",
            "DeepSpeed config",
        ),
        (
            ["launcher", "--config", "config.yaml", "--script", "train.py", "-o", "train.py"],
            "train.py",
            "training script",
        ),
    ],
)
def test_output_equal_to_an_input_is_refused(run_cli, here, args, victim, what):
    (here / "sub").mkdir()
    (here / "train.py").write_text("print('train')\n")
    before = (here / victim).read_text()
    one_line_error(run_cli(*args), f"is this command's {what}", "choose another --output")
    assert (here / victim).read_text() == before


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_output_reaching_an_input_through_a_link_is_refused(run_cli, here, link):
    (os.symlink if link == "symlink" else os.link)("config.yaml", here / "run.sh")
    one_line_error(run_cli("launcher", "--config", "config.yaml", "-o", "run.sh"), "is this command's run config")
    assert (here / "config.yaml").read_text() == RUN_CONFIG


def test_plan_write_never_replaces_its_run_config(run_cli, here):
    """A run config may have any name: one called ds_config.json in the --write folder is not overwritten."""
    (here / "cfg").mkdir()
    (here / "cfg" / "ds_config.json").write_text(RUN_CONFIG)
    result = run_cli(
        "plan",
        "--config",
        "cfg/ds_config.json",
        "--num_gpus",
        "8",
        "--gpu_memory",
        "80GB",
        "--strategy",
        "zero3",
        "--write",
        "cfg",
    )
    assert result.exit_code == 1 and "--write" in result.stderr and "is this command's run config" in result.stderr
    assert (here / "cfg" / "ds_config.json").read_text() == RUN_CONFIG


def test_write_atomic_takes_the_inputs(tmp_path):
    source = tmp_path / "in.yaml"
    source.write_text("x")
    with pytest.raises(DistsetupError, match="is this command's run config"):
        write_atomic(source, "y", inputs={"run config": str(source)})
    write_atomic(tmp_path / "out.sh", "y", inputs={"run config": str(source), "nothing": None})
    assert source.read_text() == "x" and (tmp_path / "out.sh").read_text() == "y"


# --- 15: an output that is a symbolic link -----------------------------------------------------------


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda d: os.symlink("nowhere.json", d / "out.json"), "which does not exist"),
        (lambda d: (os.symlink("loop2", d / "out.json"), os.symlink("out.json", d / "loop2")), "cannot be followed"),
    ],
)
def test_output_link_to_nothing_or_a_loop_is_refused_and_kept(run_cli, tmp_path, make, words):
    make(tmp_path)
    target = os.readlink(tmp_path / "out.json")
    one_line_error(run_cli("deepspeed", "-o", tmp_path / "out.json"), "--output", "symbolic link", words)
    assert os.readlink(tmp_path / "out.json") == target  # still the user's link, not a regular file


def test_output_link_to_a_file_writes_the_file_and_keeps_the_link(run_cli, tmp_path):
    (tmp_path / "real.json").write_text("old")
    os.symlink("real.json", tmp_path / "out.json")
    assert run_cli("deepspeed", "--zero_stage", "2", "-o", tmp_path / "out.json").exit_code == 0
    assert os.readlink(tmp_path / "out.json") == "real.json"
    assert json.loads((tmp_path / "real.json").read_text())["zero_optimization"]["stage"] == 2


def test_output_that_is_not_a_regular_file_is_refused(run_cli, tmp_path):
    os.mkfifo(tmp_path / "fifo.json")
    one_line_error(run_cli("fsdp", "-o", tmp_path / "fifo.json"), "--output", "not a regular file")


# --- 6 and 12: every option of every command refuses NaN, infinities and empty values ----------------


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
        except DistsetupError:
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
    ],
)
def test_empty_values_are_refused_not_taken_as_not_given(run_cli, here, args, flag):
    one_line_error(run_cli(*args), f"{flag} is empty")
    assert not (here / "scripts").exists()


@pytest.mark.parametrize("value", ['""', '"   "'])
def test_blank_output_dir_is_a_run_config_problem(tmp_path, value):
    (tmp_path / "config.yaml").write_text(f"training:\n  output_dir: {value}\n")
    assert "is empty" in problems_of(tmp_path / "config.yaml")["training.output_dir"].message


# --- 7: hostile files are refused fast by the one bounded reader -------------------------------------


def fenced_cli(*args) -> subprocess.CompletedProcess:
    """`distsetup ARGS` in a fresh interpreter held to 2 GiB and 30 s: where the bug this guards against came
    back, a hang or a runaway allocation fails this test instead of taking the test run (or the machine) down."""

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))

    try:
        return subprocess.run(
            [sys.executable, "-m", "distsetup", *map(str, args)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
            preexec_fn=limit_memory,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"distsetup {' '.join(map(str, args))} ran for 30 s")


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
    assert time.monotonic() - start < 3


def test_a_few_anchors_still_work():
    assert parse_yaml("base: &lr 3.0e-4\ntraining: {lr: *lr}\n")["training"]["lr"] == 3e-4


@pytest.mark.parametrize(
    "text, path, words",
    [
        ("training: {1: 2}\n", "training.1", "key 1 (int) is not a name"),
        ("yes: 1\n", "True", "(bool) is not a name"),
        ("model:\n  n_embd: 1e23\n", "model.n_embd", "out of range"),
        ("model:\n  n_layer: 100000\n", "model.n_layer", "at most 4096"),
        ("model:\n  vocab_size: 10000000\n  n_head: 5000\n", "model.n_head", "at most 1024"),
        ("model:\n  n_embd: 64.0\n", "model.n_embd", "not a whole number"),
        ("training:\n  micro_batch_size: 8.0\n", "training.micro_batch_size", "not a whole number"),  # 9
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


# --- 10, 11: counts with sane maxima; plan's numbers -------------------------------------------------


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


# --- 13: contradictions ----------------------------------------------------------------------------


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
            ["--micro_batch_size", "4", "--gradient_accumulation_steps", "4", "--train_batch_size", "15"],  # 17
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


# --- 4: every reader of a DeepSpeed file checks what validate checks -------------------------------

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


# --- 16: no pipeline in a generated script dies of SIGPIPE ------------------------------------------

# Writes 4,000 host names in four writes with a pause between: a reader that stops after the first line
# (head -n1) is gone by the second write, which then kills scontrol with SIGPIPE.
FAKE_SCONTROL = """#!/bin/bash
if [[ "$1 $2" == "show hostnames" ]]; then
  for chunk in 0 1 2 3; do
    printf 'gpu%05d\\n' $(seq $((chunk * 1000)) $((chunk * 1000 + 999)))
    sleep 0.2
  done
fi
"""


@pytest.mark.parametrize("method", ["torchrun", "deepspeed"])
def test_slurm_script_survives_a_long_host_list(tmp_path, method):
    spec = SlurmSpec(
        launch=LaunchSpec(
            num_nodes=4000,
            nproc_per_node=8,
            config="config.yaml",
            launch_method=method,
            rdzv_backend="c10d" if method == "torchrun" else "static",
        )
    )
    text = build_slurm_script(spec, command_line="distsetup slurm ...")
    fake = fake_tools(tmp_path)
    (fake / "scontrol").write_text(FAKE_SCONTROL)
    (fake / "scontrol").chmod(0o755)
    env = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "4000", "SLURM_JOB_NODELIST": "gpu[00000-03999]"}
    result = run_script(text, tmp_path, "srun", env=env, show_env=("MASTER_ADDR",))
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    assert "MASTER_ADDR=gpu00000" in result.stdout


def test_no_template_pipes_into_a_reader_that_stops_early():
    """`cmd | head`, `| grep -q`, `| grep -m`: the reader exits before cmd is done; under pipefail, 141."""
    for template in (REPO / "templates").glob("*.j2"):
        for number, line in enumerate(template.read_text().splitlines(), 1):
            pipes = [] if line.lstrip().startswith(("#", "{#")) else line.split("|")[1:]
            assert not any(
                p.split()[:1] == ["head"] or p.split()[:2] in (["grep", "-q"], ["grep", "-m"]) for p in pipes
            ), f"{template.name}:{number}: {line}"
