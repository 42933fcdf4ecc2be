"""Benchmark 8 (issue 37's demonstration): a model of about 0.8B parameters trains 2 steps on 8 CPU processes of one
machine, under FSDP2 and ZeRO-3, where 8 whole fp32 copies (one per process, as DDP would build) need 26 GB: the
built-in GPT from a fresh start, and a Llama-shaped Hugging Face model saved as safetensors and fine-tuned from it.

Each row: every rank's peak resident memory (set-up or training, whichever is higher) from summary.json, rank 0's
and the largest of the others', their sum over the node against what 8 whole copies would need, and the loss. A run
that fails is a row that says why. Slow (minutes a run on 2 cores) and outside `make bench`: `make bench-big`.
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, launch, record, table

from distsetup.planning.models import gpt_params

LAYERS, HIDDEN, HEADS, VOCAB, POSITIONS = 24, 1664, 13, 256, 64
LLAMA_MLP = 4480  # with LAYERS x HIDDEN: about 0.80B parameters, as the GPT

SAVE_LLAMA = """
import sys, torch, transformers
config = transformers.LlamaConfig(hidden_size={h}, intermediate_size={mlp}, num_hidden_layers={layers},
    num_attention_heads={heads}, num_key_value_heads={heads}, vocab_size={vocab}, max_position_embeddings={positions},
    tie_word_embeddings=False)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config)
model.save_pretrained(sys.argv[1], safe_serialization=True)
print(sum(p.numel() for p in model.parameters()))
"""


def save_llama(folder: Path, layers: int) -> int:
    """A Llama-shaped model of about 0.8B parameters, in fp32 safetensors, built and saved by a process of its own
    (its memory is gone before the runs); its parameter count."""
    code = SAVE_LLAMA.format(h=HIDDEN, mlp=LLAMA_MLP, layers=layers, heads=HEADS, vocab=VOCAB, positions=POSITIONS)
    out = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def run(model: list[str], backend: str, processes: int, work: Path, name: str) -> dict:
    """One run's summary.json: 2 steps of micro-batch 1 on `processes` ranks."""
    out = work / name
    overrides = [
        *model,
        "training.max_steps=2",
        "training.micro_batch_size=1",
        "training.gradient_accumulation_steps=1",
        "training.checkpoint_interval=1000",
        "training.eval_interval=1000",
        "training.warmup_steps=0",
        "training.precision=fp32",
        f"training.output_dir={out}",
    ]
    if backend == "zero3":
        ds = work / f"{name}.json"
        batch = {"train_batch_size": processes, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
        ds.write_text(json.dumps({**batch, "zero_optimization": {"stage": 3}}))
        overrides += ["distributed.backend=deepspeed", f"distributed.deepspeed_config={ds}"]
    else:
        overrides += ["distributed.backend=fsdp"]
    launch(processes, ["src/train.py", "--config", REPO / "config" / "config.yaml", *overrides, "--no_resume"])
    return json.loads((out / "summary.json").read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--backends", nargs="+", default=["fsdp", "zero3"], choices=["fsdp", "zero3"])
    parser.add_argument("--models", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama"])
    parser.add_argument("--layers", type=int, default=LAYERS, help="blocks of both models (24: about 0.8B)")
    a = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="big-model-") as work:
        work = Path(work)
        sizes, settings = {}, {}
        if "gpt" in a.models:
            sizes["gpt"] = gpt_params(VOCAB, POSITIONS, a.layers, HIDDEN)
            shape = [f"model.n_layer={a.layers}", f"model.n_embd={HIDDEN}", f"model.n_head={HEADS}"]
            settings["gpt"] = [*shape, f"model.vocab_size={VOCAB}", f"model.block_size={POSITIONS}"]
        if "llama" in a.models:
            sizes["llama"] = save_llama(work / "llama", a.layers)
            settings["llama"] = ["model.type=hf", f"model.hf_path={work / 'llama'}", f"model.block_size={POSITIONS}"]
        for model, overrides in settings.items():
            whole = 4 * sizes[model]
            for backend in a.backends:
                name = f"{model}-{backend}"
                start = time.perf_counter()
                try:
                    summary = run(overrides, backend, a.processes, work, name)
                except RuntimeError as e:
                    said = [line for line in str(e).splitlines() if line.startswith("error:")]
                    why = re.search(
                        r"need ([\d.,]+ GiB), more than this machine's ([\d.,]+ GiB)", said[-1] if said else ""
                    )
                    result = f"refused: needs {why[1]}, {why[2]} free" if why else "failed"
                    rows.append([model, backend, a.processes, "", "", "", whole * a.processes / 1e9, result])
                    print(f"{name} failed: {said[-1] if said else str(e)[-2000:]}", file=sys.stderr)
                    continue
                peaks = summary["host_peak_bytes"]
                each = [max(s, t) for s, t in zip(peaks["setup"], peaks["training"], strict=True)]
                rows.append(
                    [
                        f"{model} ({sizes[model] / 1e9:.2f}B)",
                        backend,
                        a.processes,
                        each[0] / 1e9,
                        max(each[1:]) / 1e9,
                        sum(each) / 1e9,
                        whole * a.processes / 1e9,
                        f"loss {summary['final_loss']:.3f}, {time.perf_counter() - start:.0f} s",
                    ]
                )
    text = table(
        [
            "model",
            "backend",
            "W",
            "rank 0 peak (GB)",
            "others' peak (max, GB)",
            "all ranks (GB)",
            "W whole fp32 copies (GB)",
            "result",
        ],
        rows,
    )
    text += (
        "\n\nfp32, micro-batch 1 x 64 positions, 2 steps, one machine. Peaks: each rank's resident-memory high-water "
        "mark (python, torch and the libraries included), at set-up or in training; 'all ranks': their sum, at most "
        "what the node held at once. The GPT starts fresh (rank 0's values); the Llama is fine-tuned from its "
        "safetensors (FSDP2: each rank reads its shards' rows; ZeRO-3: rank 0 one parameter at a time). 'refused': "
        "the trainer's memory check, before any process group."
    )
    size = max(sizes.values()) / 1e9
    names = ", ".join({"fsdp": "FSDP2", "zero3": "ZeRO-3"}[b] for b in a.backends)
    record(f"A {size:.1f}B model on {a.processes} CPU processes ({names})", text)


if __name__ == "__main__":
    main()
