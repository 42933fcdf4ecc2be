"""ZeRO-3's buffer sizes against its step's pace and peak: src/train.py's ZeRO-3 run of one model with a file that
leaves the sizes unset (the trainer keeps DeepSpeed's defaults where the rank has room for them, else sizes them from
the hidden size, and sub_group_size always: planning.estimates.keeps_deepspeed_sizes), with the sizes from the hidden
size written in the file (formats.deepspeed.MODEL_SIZED, as `distsetup deepspeed --hidden_size` writes them), under
the HF integration's "auto" three alone, and under DeepSpeed's own defaults, beside the plain run of the same model
(its tokens/s the 1 of the ratio column).

From the hidden size h, the reduce and prefetch buckets and the persistence threshold are sized as the HF
integration's "auto" does (h^2, 0.9 h^2, 10 h), and the parameters kept gathered, the distance they are kept over and
the optimizer's sub-group at a block or two (24 h^2, 12 h^2, 12 h^2) where DeepSpeed keeps 1e9 elements of each, the
whole of a model up to that size. This measures what each choice costs in speed and gains in memory. Default: the GPU
check's 1B GPT on one GPU, bf16.
"""

import argparse
import itertools
import json
import shutil
import sys
import tempfile
from pathlib import Path

from common import add_run_arguments, launch, median, record, rounds, table, train_py_argv

from distsetup.formats.deepspeed import DEEPSPEED_DEFAULTS, MODEL_SIZED, unset_sizes

DEFAULT_SIZES = {key: DEEPSPEED_DEFAULTS[key] for key in MODEL_SIZED}  # DeepSpeed's, of the six the trainer may fill in

PLAIN = "plain (no ZeRO)"
NAMES = {
    "unset": "ZeRO-3, the file leaving them unset",  # the trainer's choice
    "from_h": "ZeRO-3, sized from h",
    "hf_auto": "ZeRO-3, HF auto's three",
    "defaults": "ZeRO-3, DeepSpeed's defaults",
}


def variants(h: int, chosen: list[str]) -> dict[str, dict | None]:
    """run name -> the zero_optimization sizes its file sets (None: the plain run, no DeepSpeed), for the `chosen`
    keys of NAMES."""
    hf_auto = {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h)}
    hf_auto["stage3_param_persistence_threshold"] = 10 * h
    sizes = {
        "unset": {},
        "from_h": {**DEFAULT_SIZES, **unset_sizes({"stage": 3}, h)},
        "hf_auto": {**DEFAULT_SIZES, **hf_auto},
        "defaults": DEFAULT_SIZES,
    }
    return {PLAIN: None} | {NAMES[key]: sizes[key] for key in chosen}


def measure(name: str, sizes: dict | None, work: Path, a):
    runs = itertools.count()

    def run() -> dict:
        out = work / f"run-{next(runs)}-{len(name)}"
        overrides = ["distributed.backend=single"]
        if sizes is not None:
            ds = out.with_suffix(".json")
            zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True, **sizes}
            config = {"train_micro_batch_size_per_gpu": a.micro_batch_size, "gradient_clipping": 1.0}
            config |= {"bf16": {"enabled": a.precision == "bf16"}, "zero_optimization": zero}
            ds.write_text(json.dumps(config))
            overrides = ["distributed.backend=deepspeed", f"distributed.deepspeed_config={ds}"]
        launch(1, train_py_argv(a, out, overrides))
        summary = json.loads((out / "summary.json").read_text())
        shutil.rmtree(out)  # the final checkpoint: 12 GB for 1B parameters
        tokens_per_s = a.micro_batch_size * a.block_size / summary["median_step_seconds"]
        return {"tokens_per_s": tokens_per_s, "peak_gb": (summary.get("peak_device_bytes") or 0) / 1e9}

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(
        parser, n_layer=20, n_head=16, n_embd=2048, block_size=2048, micro_batch_size=4, steps=12, precision="bf16"
    )
    parser.add_argument("--repeats", type=int, default=1, help="alternating rounds; each figure is their median")
    parser.add_argument("--runs", nargs="+", choices=list(NAMES), default=list(NAMES), help="beside the plain run")
    parser.add_argument("--work_dir", type=Path, help="where the runs write (their checkpoints); default: a temp dir")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-zero3-", dir=a.work_dir) as work:
        measures = {name: measure(name, sizes, Path(work), a) for name, sizes in variants(a.n_embd, a.runs).items()}
        samples = rounds(measures, a.repeats)
    medians = {name: median(values) for name, values in samples.items()}
    plain = medians[PLAIN]["tokens_per_s"]
    rows = []
    for name, m in medians.items():
        spread = [s["tokens_per_s"] / plain for s in samples[name]]
        rows.append([name, m["tokens_per_s"], m["tokens_per_s"] / plain, f"{min(spread):.3f}-{max(spread):.3f}"])
        rows[-1].append(m["peak_gb"])
    text = table(["run", "tokens/s", "vs plain", "range over rounds", "peak GB"], rows)
    text += (
        f"\n\nGPT {a.n_layer} layers x {a.n_embd} ({a.n_head} heads), sequence {a.block_size}, micro batch "
        f"{a.micro_batch_size}, {a.precision}, {a.steps} steps, one process; tokens/s from each run's median step, "
        f"medians of {a.repeats} alternating rounds. 'peak GB': torch.cuda.max_memory_allocated (0 on the CPU)."
    )
    record("ZeRO-3's buffer sizes against its pace", text)


if __name__ == "__main__":
    sys.exit(main())
