"""`distsetup init`: answers from a person at a terminal (a real pseudo-terminal), from flags with --yes, and
from what it detects; bad answers are asked again in a terminal, and are one line with nothing written otherwise.
(The files it writes, trained on CPU processes: tests/processes/test_init_trains.py; on the test SLURM cluster:
tests/processes/test_slurm_jobs.py.)"""

import json
import re
import shlex
import subprocess
import sys

import click
import pytest
from hostile_input import one_line_error
from init_terminal import environment, files_in, interrupt_at_the_prompt, spawn_init
from repo import heavy_imports

from distsetup.cli.commands.init import Questions, _data, _model, _reasked, ask_everything
from distsetup.cli.init_setup import Answers, build_setup
from distsetup.cli.machine import Machine
from distsetup.errors import DistsetupError
from distsetup.formats.runconfig import PRECISIONS, TrainingConfig
from distsetup.planning.gpus import GpuInfo


def gpu(index: int, gib: int = 80, capability=(9, 0)) -> GpuInfo:
    memory = gib * 2**30
    return GpuInfo(index, "NVIDIA H100", memory, 0, memory, 0, compute_capability=capability)


def answers_with_defaults(machine: Machine, **given) -> Answers:
    return ask_everything(Questions({"max_steps": 1000, **given}, yes=True), machine)


def test_ctrl_c_during_the_questions_writes_nothing(tmp_path):
    init = spawn_init(tmp_path)
    init.expect_exact("Model: a built-in size")
    init.sendline("")
    init.expect_exact("Training data")
    interrupt_at_the_prompt(init)
    init.close()
    assert init.exitstatus == 1 and "init stopped at a question: nothing was written." in init.before
    assert files_in(tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_without_a_terminal_and_without_yes_it_says_so_and_writes_nothing(tmp_path):
    closed = subprocess.run(
        [sys.executable, "-m", "distsetup", "init"],
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert closed.returncode == 1
    error = [line for line in closed.stderr.splitlines() if line.startswith("Error")]
    assert error == [
        "Error: distsetup init would ask for --model, and stdin is not a terminal. HINT: add --yes (defaults for "
        "every answer not given as a flag), or run it in a terminal."
    ]
    assert list(tmp_path.iterdir()) == []


def test_existing_files_are_kept_without_force_and_replaced_with_it(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text("mine\n")
    refused = run_cli("init", "--yes")
    assert refused.exit_code == 1 and "config/config.yaml exists" in refused.stderr
    assert (tmp_path / "config" / "config.yaml").read_text() == "mine\n"
    assert files_in(tmp_path) == ["config/config.yaml"]

    (tmp_path / "config" / "config.yaml").unlink()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "run_training.sh").write_text("mine\n")
    refused = run_cli("init", "--yes")  # found only once the answers say which script: still nothing written
    assert refused.exit_code == 1 and "scripts/run_training.sh exists" in refused.stderr
    assert files_in(tmp_path) == ["scripts/run_training.sh"]

    forced = run_cli("init", "--yes", "--force")
    assert forced.exit_code == 0, forced.output
    assert "mine" not in (tmp_path / "scripts" / "run_training.sh").read_text()
    assert files_in(tmp_path) == ["config/config.yaml", "scripts/run_training.sh"]
    written_by = (tmp_path / "config" / "config.yaml").read_text().splitlines()[1].removeprefix("#   ")
    again = run_cli(*shlex.split(written_by)[1:])  # the header's command, pasted after an edit by hand: kept
    assert again.exit_code == 1 and "config/config.yaml exists" in again.stderr, written_by


def test_a_write_that_fails_part_way_leaves_nothing_behind(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scripts").write_text("a file where the scripts folder would go\n")
    result = run_cli("init", "--yes")
    assert result.exit_code == 1 and "run distsetup init in a folder you can write to" in result.stderr
    assert files_in(tmp_path) == ["scripts"] and not (tmp_path / "config").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "folder"], "--model folder has no config.json."),
        (["--model", "nowhere"], "--model nowhere is neither a built-in size nor a folder."),
        (
            ["--model", "ad_model:build"],
            "for your own model (ad_model:build), init a built-in size, then set model.type",
        ),
        (["--num_gpus_per_node", "0"], "--num_gpus_per_node: 0 is not in the range 1<=x<=1024."),
        (["--num_nodes", "0"], "--num_nodes: 0 is not in the range"),
        (
            ["--scheduler", "slurm", "--gpu_memory", "none", "--time_limit", "25h"],
            "--time_limit: time limit '25h' is not one SLURM accepts.",
        ),
        (  # its hint named only --signal_seconds, which init does not have
            ["--scheduler", "slurm", "--gpu_memory", "none", "--time_limit", "2:00"],
            "the time limit 2:00 (120 s) is not longer than the preemption warning, 120 s before it (--signal_seconds)"
            ": the job would be warned as it starts, and requeued again and again. HINT: give a longer --time_limit",
        ),
        (["--gpu_memory", "lots"], "--gpu_memory: cannot read 'lots' as an amount of memory."),
        (["--data", "missing.jsonl"], "--data: file missing.jsonl does not exist."),
        (["--global_batch_size", "3"], "--global_batch_size 3 is not divisible by the 2 processes"),
        (["--data", ","], "--data ',' names no file."),
        # each answer checked at its question, as the run config checks it: these failed after the last one
        (["--data", "d.csv"], "--data: d.csv is not a .txt, .jsonl, .json, .parquet or .bin file."),
        (["--data", "a.bin,b.txt"], "--data: b.txt: a pre-tokenized .bin file is the only file of its split."),
        (["--data", "folder"], "--data: folder is a folder."),
        (["--data", "body.jsonl"], "--data: body.jsonl: its first record has no field 'text'"),
        (["--partition", "gpu"], "--partition is for a SLURM job, and --scheduler local runs on this machine."),
        (["--model", "broken"], "broken/config.json is not valid JSON"),
        (
            ["--scheduler", "slurm", "--gpu_memory", "none", "--partition", "gpu queue"],
            "partition 'gpu queue' is not a SLURM partition name.",
        ),
        (
            ["--scheduler", "slurm", "--gpu_memory", "none", "--account", "my account"],
            "--account 'my account' is not a SLURM account name",  # sbatch refused it, at submission
        ),
        (["--scheduler", "slurm"], "no GPU here to measure, and --gpu_memory is not given for the SLURM nodes."),
        (
            ["--model", "folder-7b", "--seq_len", "8192"],
            "--seq_len 8192 is longer than the 4096 positions folder-7b's config.json allows",
        ),
        (
            ["--model", "xl", "--gpu_memory", "1GB", "--num_gpus_per_node", "1"],
            "nothing fits: xl (1.48B parameters, bf16, sequence 1024) on 1 node(s) x 1 GPU(s) of 1 GB. HINT: what "
            "would: a GPU of 1 GB leaves 0.90 GB usable, less than the 1.0 GB each process takes before any model",
        ),
    ],
)
def test_bad_answers_are_one_line_and_write_nothing(run_cli, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder-7b").mkdir()
    (tmp_path / "folder-7b" / "config.json").write_text(json.dumps(LLAMA_7B))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    (tmp_path / "d.csv").write_text("a,b\n")
    (tmp_path / "body.jsonl").write_text('{"body": "hello"}\n')
    (tmp_path / "a.bin").write_bytes(b"")
    (tmp_path / "b.txt").write_text("hello")
    result = run_cli("init", "--yes", *args)
    one_line_error(result, message)
    assert files_in(tmp_path) == [
        "a.bin",
        "b.txt",
        "body.jsonl",
        "broken/config.json",
        "d.csv",
        "folder-7b/config.json",
    ]


def test_a_slurm_flag_for_a_local_scheduler_is_refused_before_any_question():
    """Asked in a terminal, `init --scheduler local --partition gpu` was refused after the model, data and scheduler
    questions, their answers lost. (Without a terminal, a question would say so instead: it comes first.)"""
    questions = Questions({"scheduler": "local", "partition": "gpu"}, yes=False)
    with pytest.raises(DistsetupError, match="--partition is for a SLURM job"):
        ask_everything(questions, Machine(no_gpu_reason="no driver", cpu_count=2))


def test_a_wrong_answer_is_asked_again_at_its_question(tmp_path):
    """What the terminal's prompt does with an answer: spaces around it and capitals are no part of it; a file the run
    config cannot read is said at its question (click.prompt asks again), not after the last."""
    assert _reasked(click.Choice(PRECISIONS, case_sensitive=False), None, "precision")(" FP32 ") == "fp32"
    assert _reasked(str, _model, "model")(" tiny ") == "tiny"
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(click.BadParameter) as refused:  # the answer's, not a flag's: none was given
        _reasked(str, _data, "data")(str(tmp_path / "notes.csv"))
    assert refused.value.message.startswith(f"{tmp_path / 'notes.csv'} is not a .txt"), refused.value.message
    with pytest.raises(click.BadParameter, match="^',' names no file"):
        _reasked(str, _data, "data")(" , ")


def test_defaults_come_from_the_gpus_and_the_slurm_allocation():
    h100s = Machine(gpus=(gpu(0), gpu(1)))
    local = answers_with_defaults(h100s)
    assert (local.num_gpus_per_node, local.precision, local.scheduler, local.global_batch_size) == (
        2,
        "bf16",
        "local",
        16,
    )
    assert local.gpu_memory == f"{80 * 2**30 / 1e9:.1f}GB"
    v100s = Machine(gpus=(gpu(0, 32, (7, 0)), gpu(1, 16, (7, 0))))
    assert answers_with_defaults(v100s).precision == "fp16"  # no bf16 before Ampere
    assert answers_with_defaults(v100s).gpu_memory == f"{16 * 2**30 / 1e9:.1f}GB"  # the smallest GPU
    cpu = answers_with_defaults(Machine(no_gpu_reason="no driver", cpu_count=8))
    assert (cpu.gpu_memory, cpu.precision, cpu.num_gpus_per_node) == (None, "fp32", 2)
    allocation = {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_JOB_PARTITION": "gpu",
        "SLURM_JOB_ACCOUNT": "ml",
    }
    job = answers_with_defaults(Machine(gpus=(gpu(0),), slurm=allocation, venv="/opt/venv"))
    assert (job.scheduler, job.num_nodes, job.num_gpus_per_node, job.global_batch_size) == ("slurm", 4, 8, 256)
    assert (job.partition, job.account, job.venv, job.time_limit) == ("gpu", "ml", "/opt/venv", "24:00:00")
    assert answers_with_defaults(Machine(gpus=(gpu(0),), slurm=allocation), num_nodes=2).num_nodes == 2  # flags win


def test_gpu_setup_writes_the_file_distsetup_plan_recommends(run_cli, tmp_path, monkeypatch):
    """init and `distsetup plan` choose alike: the same planner, the same builders."""
    monkeypatch.chdir(tmp_path)
    args = ["--model", "xl", "--gpu_memory", "24GB", "--num_gpus_per_node", "8", "--global_batch_size", "64"]
    result = run_cli("init", "--yes", *args)
    assert result.exit_code == 0, result.output
    (written,) = [p for p in (tmp_path / "config").glob("*.json")]
    plan = run_cli(
        "plan",
        "--config",
        "config/config.yaml",
        "--num_gpus_per_node",
        8,
        "--gpu_memory",
        "24GB",
        "--global_batch_size",
        64,
        "--json",
        "--write",
        tmp_path / "planned",
    )
    assert plan.exit_code == 0, plan.output
    assert json.loads((tmp_path / "planned" / written.name).read_text()) == json.loads(written.read_text())
    recommendation = json.loads(plan.stdout)["recommendation"]
    config = (tmp_path / "config" / "config.yaml").read_text()
    assert f"micro_batch_size: {recommendation['micro_batch_size']}\n" in config
    assert f"gradient_accumulation_steps: {recommendation['gradient_accumulation_steps']}\n" in config
    assert f"Strategy: {recommendation['label']}" in result.stdout
    assert run_cli("validate", "config/config.yaml", "--world_size", 8).exit_code == 0


LLAMA_7B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}


def test_a_hugging_face_folder_is_planned_from_its_config(tmp_path):
    folder = tmp_path / "my-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_7B))
    answers = Answers(str(folder), (), "slurm", 2, 8, "80GB", "bf16", 128, time_limit="24:00:00")
    setup = build_setup(answers, str(tmp_path))
    config = setup.files["config/config.yaml"][0]
    assert f"hf_path: {folder}\n" in config and "block_size: 2048\n" in config  # the context, at most 2048
    assert "6.74B parameters" in setup.summary[0]  # Llama-2-7B's count, as people say it (not 6,738.4M)
    assert "tokenizer:" not in config  # a folder without tokenizer files: byte-level text
    (folder / "tokenizer.json").write_text("{}")
    config = build_setup(answers, str(tmp_path)).files["config/config.yaml"][0]
    assert f"tokenizer: {folder}\n" in config  # the model's own tokenizer
    fsdp = [text for path, (text, _) in setup.files.items() if path.endswith("fsdp_config.json")]
    if fsdp:  # the planner's call; where it is FSDP, the model's own decoder layer is wrapped
        assert json.loads(fsdp[0])["fsdp_transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    assert setup.next_command == "sbatch scripts/slurm_job.sh"
    # the backend and its file are the run config's, read when the job starts: an edit of the run config counts
    assert "TRAIN_ARGS=(--config config/config.yaml)\n" in setup.files["scripts/slurm_job.sh"][0]


def test_fp16_never_gets_fsdp_which_the_trainer_cannot_scale(run_cli, tmp_path, monkeypatch):
    """At bf16 the planner's choice for this case is FSDP; at fp16 (GPUs before Ampere) it must be another."""
    monkeypatch.chdir(tmp_path)
    args = ["--yes", "--model", "xl", "--gpu_memory", "9GB", "--num_gpus_per_node", "4"]
    assert run_cli("init", *args, "--precision", "bf16").exit_code == 0
    assert (tmp_path / "config" / "fsdp_config.json").exists()
    assert run_cli("init", *args, "--precision", "fp16", "--force").exit_code == 0
    config = (tmp_path / "config" / "config.yaml").read_text()
    assert "backend: fsdp" not in config and "precision: fp16" in config
    fsdp_fp16 = config.replace("backend: deepspeed", "backend: fsdp").replace("deepspeed_config:", "fsdp_config:")
    (tmp_path / "config" / "config.yaml").write_text(fsdp_fp16.replace("ds_config.json", "fsdp_config.json"))
    refused = run_cli("validate", "config/config.yaml", "--json")
    assert [p["path"] for p in json.loads(refused.stdout)] == ["training.precision"]


def test_a_deepspeed_file_trains_with_the_run_configs_optimizer_settings(run_cli, tmp_path, monkeypatch):
    """init's DeepSpeed file said lr 3e-4 and betas (0.9, 0.999), DeepSpeed's defaults, which override the run
    config's (1e-3, (0.9, 0.95)): the same answers trained at another lr under ZeRO than under DDP. plan --write of a
    run config carries its values as well, in the file and in the command it prints."""
    monkeypatch.chdir(tmp_path)
    assert run_cli("init", "--yes", "--model", "large", "--gpu_memory", "16GB", "--num_gpus_per_node", 2).exit_code == 0
    optimizer = json.loads((tmp_path / "config" / "ds_config.json").read_text())["optimizer"]["params"]
    training = TrainingConfig()
    assert (optimizer["lr"], optimizer["betas"], optimizer["weight_decay"]) == (
        training.lr,
        training.betas,
        training.weight_decay,
    )
    checked = run_cli("validate", "config/config.yaml")
    assert checked.exit_code == 0 and "from DeepSpeed file" not in checked.output
    config = (tmp_path / "config" / "config.yaml").read_text().replace("training:\n", "training:\n  lr: 0.0002\n", 1)
    (tmp_path / "config" / "config.yaml").write_text(config)
    planned = run_cli(
        "plan",
        "--config",
        "config/config.yaml",
        "--gpu_memory",
        "16GB",
        "--num_gpus",
        2,
        "--json",
        "--write",
        "planned",
    )
    assert planned.exit_code == 0, planned.output
    assert json.loads((tmp_path / "planned" / "ds_config.json").read_text())["optimizer"]["params"]["lr"] == 2e-4
    assert "--lr 0.0002 --betas 0.9 0.95 --weight_decay 0.01" in json.loads(planned.stdout)["command"]
    command = shlex.split(json.loads(planned.stdout)["command"])
    assert command[-2:] == ["--output", "planned/ds_config.json"]  # where --write wrote it, not config/
    written = json.loads((tmp_path / "planned" / "ds_config.json").read_text())
    assert run_cli(*command[1:]).exit_code == 0
    assert json.loads((tmp_path / "planned" / "ds_config.json").read_text()) == written


def test_the_summary_says_why_with_numbers_that_hold(tmp_path):
    """Each faster strategy it names needs more than the usable memory: that is why it was passed over."""
    answers = Answers("xl", (), "local", 1, 4, "16GB", "bf16", 32)
    (why,) = [line for line in build_setup(answers, str(tmp_path)).summary if line.startswith("Strategy:")]
    usable = float(re.search(r"fits (\d+\.\d) GB usable", why).group(1))
    needs = [float(n) for n in re.findall(r" (\d+\.\d) GB", why.split("faster ones need more")[1])]
    assert needs and all(n > usable for n in needs), why


def test_init_never_imports_torch_or_the_clients(tmp_path):
    args = ["init", "--yes", "--gpu_memory", "80GB", "--model", "xl"]
    assert heavy_imports(args, ("torch", "deepspeed", "transformers", "accelerate"), cwd=tmp_path) == ([], 0)
