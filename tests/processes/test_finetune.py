"""Fine-tuning a tiny Llama on chat data with a locally trained BPE tokenizer, as a user's run config says it:
2 processes under DDP, FSDP and ZeRO-3 follow the single-process loss curve (the loss is the mean over every
assistant token of the step, however the batch is split), the validation loss falls, and the token files of
the cache, read as pre-tokenized data, train exactly as the text they came from."""

import json

import pytest
import yaml
from text_data import chat_records, write_jsonl, write_llama, write_tokenizer
from train_runs import DS_FILES, FSDP_FILES, losses, train

from distsetup.formats.checkpoint_folder import Marker, step_dir

pytest.importorskip("transformers")

STEPS, RTOL = 20, 1e-4
RUNS = {  # name -> processes, backend, backend file
    "single": (1, "single", None),
    "ddp": (2, "ddp", None),
    "fsdp": (2, "fsdp", {**FSDP_FILES["fsdp_full"], "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}),
    "zero3": (
        2,
        "deepspeed",
        {
            **DS_FILES["zero3"],
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "train_batch_size": 8,
        },
    ),
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("finetune")
    tokenizer = write_tokenizer(folder / "tokenizer")
    # a padding row, as Gemma's, OPT's and many checkpoints' configs have: transformers zeroes it as it initialises
    # the embedding, which inside deepspeed.zero.Init read an empty partition (ZeRO-3 then built the model whole)
    write_llama(folder / "llama", vocab_size=320, pad_token_id=1)
    write_jsonl(folder / "train.jsonl", chat_records(300, seed=1))
    write_jsonl(folder / "val.jsonl", chat_records(40, seed=2))
    return folder, tokenizer


def write_run(folder, inputs_folder, name, data=None):
    processes, backend, backend_file = RUNS[name]
    distributed = {"backend": backend, "timeout_minutes": 2}
    if backend_file is not None:
        key = "fsdp_config" if backend == "fsdp" else "deepspeed_config"
        (folder / "backend.json").write_text(json.dumps(backend_file))
        distributed[key] = str(folder / "backend.json")
    config = {
        "model": {
            "type": "hf",
            "hf_path": str(inputs_folder / "llama"),
            "tokenizer": str(inputs_folder / "tokenizer"),
            "block_size": 48,
        },
        "data": data
        or {
            "type": "files",
            "paths": [str(inputs_folder / "train.jsonl")],
            "val_paths": [str(inputs_folder / "val.jsonl")],
            "format": "chat",
            "cache_dir": str(inputs_folder / "cache"),
        },
        "training": {
            "micro_batch_size": 4 // processes,
            "gradient_accumulation_steps": 2,
            "max_steps": STEPS,
            "lr": 3e-3,
            "warmup_steps": 2,
            "log_interval": 1,
            "eval_interval": 10,
            "checkpoint_interval": STEPS,
            "output_dir": str(folder / "out"),
        },
        "distributed": distributed,
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder / "config.yaml", processes


def finetune(folder, inputs, name, data=None):
    (folder / name).mkdir()
    config, processes = write_run(folder / name, inputs[0], name, data)
    result = train(config, processes)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "every rank holds it whole instead" not in result.stdout, result.stdout  # ZeRO-3 built it in partitions
    return json.loads((folder / name / "out" / "summary.json").read_text()), losses(folder / name / "out")


@pytest.fixture(scope="module")
def single(inputs, tmp_path_factory):
    """The single-process run both tests compare with (it also builds the token cache)."""
    return finetune(tmp_path_factory.mktemp("single"), inputs, "single")


def test_chat_finetuning_under_every_backend(tmp_path, inputs, single):
    summary, reference = single
    evals = [e["val_loss"] for e in summary["evals"]]
    assert [e["step"] for e in summary["evals"]] == [10, 20] and evals[-1] < evals[0] - 0.2, summary["evals"]
    assert summary["val_loss"] == evals[-1] and summary["val_perplexity"] == pytest.approx(2.718281828 ** evals[-1])
    for name in ("ddp", "fsdp", "zero3"):
        parallel, curve = finetune(tmp_path, inputs, name)
        worst = max(abs(a - b) / abs(b) for a, b in zip(curve, reference, strict=True))
        assert len(curve) == STEPS and worst <= RTOL, f"{name}: relative loss difference {worst:.2e}"
        for ours, theirs in zip(parallel["evals"], summary["evals"], strict=True):
            assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=RTOL), name
        marker = Marker.read(step_dir(tmp_path / name / "out" / "checkpoints", STEPS))  # evaluated at its step
        assert marker.val_loss == parallel["evals"][-1]["val_loss"], name


def test_the_cache_token_files_train_as_the_text_they_came_from(tmp_path, inputs, single):
    folder, _ = inputs
    _, text_curve = single
    (cache,) = [p for p in (folder / "cache").iterdir() if not p.name.startswith(".")]
    data = {"type": "files", "paths": [str(cache / "train.bin")], "val_paths": [str(cache / "val.bin")]}
    (tmp_path / "tokens").mkdir()
    config, _ = write_run(tmp_path / "tokens", folder, "single", data)
    result = train(config, 1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(tmp_path / "tokens" / "out") == text_curve
