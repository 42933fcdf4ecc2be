"""Benchmark: distsetup's trainer against what users would pick instead, on the same job: the HF Trainer and a plain
Accelerate loop (benchmarks/peer_loops.py), each training the same tiny Llama (built locally from LlamaConfig,
the same weights for all) on the same synthetic tokens, micro-batch, AdamW, clipping 1.0, warmup + cosine schedule
and steps, fp32, over 2 processes under torchrun (CPU processes with gloo here): DDP (all three), FSDP2 (against
Accelerate's FSDP2 plugin) and ZeRO-3 (against the HF Trainer given the same DeepSpeed file).

One rule for every tool: a step's time is the interval between two consecutive optimizer steps' ends as the tool
itself marks them (distsetup's summary.json `step_seconds`, the HF Trainer's `on_step_end` callback, the loop's
own line after `optimizer.step()`); each run's median over the steps after the fifth. Time to first step: from
the benchmark starting the command to the first step's end (Unix time). Rounds alternate; each round's peer figure
is divided by distsetup's of the same round and the ratios' median is reported, with their range (>= 1: distsetup
is faster).

Each peer runs twice a round: as its users run it, and with distsetup's allocator settings (transparent huge pages
for large CPU tensors, and where the backend gathers weights, FSDP and ZeRO-3, glibc mapping allocations apart from
the size the trainer sets, just above a step's largest activation), so that the loops are compared on their own
merits too. At two vocabulary sizes: the default 8192, and 256, where the tensors are small and a step's fixed costs
show."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import BIN, REPO, record, rounds, table

from distsetup.planning.estimates import BY_KEY
from distsetup.training.host_allocator import mapped_apart_from

SEQ, MICRO, HIDDEN, LAYERS, HEADS = 128, 8, 256, 4, 4
VOCABULARIES = (8192, 256)
# what distsetup's trainer sets for its own process (host_allocator's ask_for_huge_pages; map_large_tensors_apart
# where the backend gathers weights, from the size mapped_apart_from gives), as environment
HUGE_PAGES = {"THP_MEM_ALLOC_ENABLE": "1"}
MAPPED_APART = "MALLOC_MMAP_THRESHOLD_"
STRATEGY_OF = {"ddp": "ddp", "fsdp": "fsdp_full_shard", "zero3": "zero3"}
SAME_ALLOCATOR = " (same allocator)"
RUNS = {  # backend -> the tools run on it; distsetup first
    "ddp": ("distsetup", "hf_trainer", "accelerate"),
    "fsdp": ("distsetup", "accelerate"),
    "zero3": ("distsetup", "hf_trainer"),
}
DEEPSPEED = {  # the file distsetup and the HF Trainer both get (no optimizer block: both pass torch's AdamW)
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3},
    "bf16": {"enabled": False},
}
FSDP = {
    "fsdp_version": 2,
    "fsdp_sharding_strategy": "FULL_SHARD",
    "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
    "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    "mixed_precision": "no",
}


def write_model(folder: Path, vocab: int) -> int:
    """The peers' Llama saved in `folder`; the size from which distsetup's trainer maps its allocations apart (where
    the backend gathers weights)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from distsetup.training.model_setup import largest_activation_bytes

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=SEQ,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return mapped_apart_from(largest_activation_bytes(model, MICRO * SEQ))


def environment() -> dict:
    """DeepSpeed's CPU ops where `make ops` builds them, the venv's tools first (as in the Makefile: another ninja's
    build log forces a rebuild), one thread per process."""
    env = {"TORCH_EXTENSIONS_DIR": str(REPO / ".torch_extensions"), **os.environ, "OMP_NUM_THREADS": "1"}
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    return env


def build_ops() -> None:
    """DeepSpeed's shared-memory collectives, compiled (if they must be) before any run is timed."""
    load = "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as S; S().load(verbose=False)"
    subprocess.run([sys.executable, "-c", load], env=environment(), check=True, capture_output=True)


def torchrun(argv: list, env_added: dict | None = None, finished=lambda stdout: False) -> tuple[str, float]:
    """(stdout, the Unix time it was started) of a 2-process torchrun of `argv`, `env_added` in its environment. A run
    that fails is an error, unless `finished(stdout)`: it did its steps and failed in its teardown, which is not
    timed (the HF Trainer's ZeRO-3 run once aborted there: "terminate called without an active exception")."""
    env = {**environment(), **(env_added or {})}
    started = time.time()
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", *map(str, argv)]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0 and not finished(result.stdout):
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    if result.returncode != 0:
        said = f"note: {argv[0]} ended with status {result.returncode} after its steps; its times count"
        print(said, file=sys.stderr)
    return result.stdout, started


def distsetup_run(backend: str, steps: int, vocab: int, work: Path) -> dict:
    out = work / f"distsetup-{backend}"
    distributed: dict = {"backend": "deepspeed" if backend == "zero3" else backend}
    if backend == "zero3":
        distributed["deepspeed_config"] = str(work / "ds.json")
    if backend == "fsdp":
        distributed["fsdp_config"] = str(work / "fsdp.json")
    config = {
        "model": {"type": "hf", "hf_path": str(work / "llama"), "block_size": SEQ, "vocab_size": vocab},
        "data": {"type": "synthetic", "num_samples": 4096, "val_fraction": 0},
        "training": {
            "micro_batch_size": MICRO,
            "max_steps": steps,
            "lr": 1e-3,
            "warmup_steps": 5,
            "grad_clip": 1.0,
            "log_interval": 10,
            "checkpoint_interval": 10 * steps,
            "report_to": [],
            "output_dir": str(out),
        },
        "distributed": distributed,
    }
    (work / f"{backend}.yaml").write_text(yaml.safe_dump(config))
    _, started = torchrun(["src/train.py", "--config", work / f"{backend}.yaml", "--no_resume"])
    summary = json.loads((out / "summary.json").read_text())
    return {
        "ran": "fsdp2" if summary["backend"] == "fsdp" else summary["backend"],
        "steps": summary["step_seconds"],
        "first": summary["first_step_done_at"] - started,
    }


def peer_run(tool: str, backend: str, steps: int, vocab: int, work: Path, env_added: dict | None) -> dict:
    argv = [REPO / "benchmarks" / "peer_loops.py", f"--tool={tool}", f"--backend={backend}"]
    argv += [f"--model={work / 'llama'}", f"--output_dir={work / tool}", f"--steps={steps}", f"--vocab={vocab}"]
    argv += [f"--seq={SEQ}", f"--micro_batch_size={MICRO}"]
    if backend == "zero3":
        argv.append(f"--deepspeed={work / 'ds.json'}")
    stdout, started = torchrun(argv, env_added, finished=lambda out: _step_ends(out) is not None)
    result = _step_ends(stdout)
    assert result is not None  # torchrun() returned: the run printed them
    ends = result["step_ends"]
    return {
        "ran": result["ran"],
        "steps": [b - a for a, b in zip(ends, ends[1:], strict=False)],
        "first": ends[0] - started,
    }


def _step_ends(stdout: str) -> dict | None:
    """peer_loops.py's last line: the tool it ran as and its steps' end times, or None before it printed them."""
    lines = stdout.strip().splitlines()
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None


def distsetup_allocator(backend: str, mapped_apart: int) -> dict:
    """The environment that gives a peer distsetup's allocator settings on `backend` (`mapped_apart`: write_model's)."""
    gathers_weights = BY_KEY[STRATEGY_OF[backend]].gathers_weights
    return HUGE_PAGES | ({MAPPED_APART: str(mapped_apart)} if gathers_weights else {})


def measures(backend: str, steps: int, vocab: int, mapped_apart: int, work: Path) -> dict:
    """Each run of a round on `backend`, as a function of no arguments: distsetup, then each peer as its users run it
    and with distsetup's allocator settings (`mapped_apart`: write_model's)."""
    runs = {"distsetup": lambda: distsetup_run(backend, steps, vocab, work)}
    for tool in RUNS[backend][1:]:
        runs[tool] = lambda tool=tool: peer_run(tool, backend, steps, vocab, work, None)
        same = distsetup_allocator(backend, mapped_apart)
        runs[tool + SAME_ALLOCATOR] = lambda tool=tool, same=same: peer_run(tool, backend, steps, vocab, work, same)
    return runs


def steady(run: dict) -> float:
    """The median step after the fifth (the first steps' one-off costs left out)."""
    return statistics.median(run["steps"][5:])


def median_and_range(ratios: list[float]) -> str:
    """The rounds' median ratio, their lowest and highest in brackets: how far one table's figure can be trusted."""
    return f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--vocabularies", type=int, nargs="+", default=list(VOCABULARIES))
    a = parser.parse_args()
    rows, mapped_apart = [], {}  # vocabulary -> the size from which distsetup maps allocations apart
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        work = Path(tmp)
        build_ops()
        (work / "ds.json").write_text(json.dumps(DEEPSPEED))
        (work / "fsdp.json").write_text(json.dumps(FSDP))
        for vocab in a.vocabularies:
            mapped_apart[vocab] = write_model(work / "llama", vocab)
            for backend in a.backends:
                results = rounds(measures(backend, a.steps, vocab, mapped_apart[vocab], work), a.repeats)
                ours = results["distsetup"]
                for tool, runs in results.items():
                    step_ratios = [steady(peer) / steady(mine) for peer, mine in zip(runs, ours, strict=True)]
                    first_ratios = [peer["first"] / mine["first"] for peer, mine in zip(runs, ours, strict=True)]
                    rows.append(
                        [
                            backend,
                            vocab,
                            tool,
                            runs[0]["ran"],
                            statistics.median(steady(run) for run in runs),
                            "" if tool == "distsetup" else median_and_range(step_ratios),
                            statistics.median(run["first"] for run in runs),
                            "" if tool == "distsetup" else median_and_range(first_ratios),
                        ]
                    )
    text = table(
        [
            "backend",
            "vocabulary",
            "tool",
            "ran as",
            "median step s",
            "peer / distsetup step",
            "time to first step s",
            "peer / distsetup first step",
        ],
        rows,
    )
    text += (
        f"\n\nTiny Llama {LAYERS} x {HIDDEN}, sequence {SEQ}, micro-batch {MICRO} per process, "
        f"2 processes, fp32, AdamW, clipping 1.0, {a.steps} steps; medians over {a.repeats} alternating rounds; "
        "ratios >= 1: distsetup is faster (the median of the rounds' ratios, their lowest and highest in "
        "brackets). 'ran as' is what each tool did with the request (on a CPU Accelerate "
        "takes no FSDP plugin: peer_loops.py sets its state to FSDP, and its own FSDP2 path runs). "
        f"'{SAME_ALLOCATOR.strip()}': the peer run with distsetup's allocator settings "
        f"({', '.join(f'{k}={v}' for k, v in HUGE_PAGES.items())}; where the backend gathers weights, fsdp and "
        f"zero3, also {MAPPED_APART}, the size from which distsetup maps allocations apart, just above a step's "
        "largest activation: "
        + ", ".join(f"{size} at vocabulary {vocab}" for vocab, size in mapped_apart.items())
        + ")."
    )
    everything = a.backends == list(RUNS) and a.vocabularies == list(VOCABULARIES)
    scope = "" if everything else f" ({', '.join(a.backends)}; vocabulary {', '.join(map(str, a.vocabularies))})"
    record("distsetup against the HF Trainer and Accelerate" + scope, text)  # the docs show the whole table's


if __name__ == "__main__":
    sys.exit(main())
