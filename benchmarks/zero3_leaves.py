"""ZeRO-3 block by block against layer by layer: src/train.py's ZeRO-3 step on peers.py's tiny Llama (2 processes,
the same file and run config) with each block a leaf module, gathered whole (the trainer's choice where the file
chooses no leaves), against the same file with `"stage3_module_granularity_threshold": 0`, where DeepSpeed hooks and
gathers each layer apart. Rounds alternate; the ratio is layer by layer's median step over block by block's (> 1:
whole blocks are quicker), the median of the rounds' with their range; the final losses of the two side by side."""

import argparse
import copy
import json
import statistics
import sys
import tempfile
from pathlib import Path

import yaml
from common import record, rounds, table
from peers import DEEPSPEED, MICRO, SEQ, build_ops, steady, torchrun, write_model

LAYER_BY_LAYER = {"stage3_module_granularity_threshold": 0}


def run(work: Path, name: str, zero: dict, vocab: int, steps: int) -> dict:
    ds = copy.deepcopy(DEEPSPEED)
    ds["zero_optimization"].update(zero)
    (work / f"{name}.json").write_text(json.dumps(ds))
    out = work / name
    training = {"micro_batch_size": MICRO, "max_steps": steps, "lr": 1e-3, "warmup_steps": 5, "grad_clip": 1.0}
    training |= {"log_interval": 10, "checkpoint_interval": 10 * steps, "report_to": [], "output_dir": str(out)}
    config = {
        "model": {"type": "hf", "hf_path": str(work / "llama"), "block_size": SEQ, "vocab_size": vocab},
        "data": {"type": "synthetic", "num_samples": 4096, "val_fraction": 0},
        "training": training,
        "distributed": {"backend": "deepspeed", "deepspeed_config": str(work / f"{name}.json")},
    }
    (work / f"{name}.yaml").write_text(yaml.safe_dump(config))
    torchrun(["src/train.py", "--config", work / f"{name}.yaml", "--no_resume"])
    summary = json.loads((out / "summary.json").read_text())
    return {"steps": summary["step_seconds"], "loss": summary["final_loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocabularies", type=int, nargs="+", default=[8192, 256])
    a = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-zero3-leaves-") as tmp:
        work = Path(tmp)
        build_ops()
        for vocab in a.vocabularies:
            write_model(work / "llama", vocab)
            measures = {
                "blocks": lambda vocab=vocab: run(work, "blocks", {}, vocab, a.steps),
                "layers": lambda vocab=vocab: run(work, "layers", LAYER_BY_LAYER, vocab, a.steps),
            }
            results = rounds(measures, a.repeats)
            pairs = zip(results["layers"], results["blocks"], strict=True)
            ratios = [steady(layers) / steady(blocks) for layers, blocks in pairs]
            blocks, layers = (statistics.median(steady(r) for r in results[name]) for name in ("blocks", "layers"))
            losses = f"{results['blocks'][0]['loss']:.7g} / {results['layers'][0]['loss']:.7g}"
            spread = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
            rows.append([vocab, blocks, layers, spread, losses])
    text = table(["vocabulary", "step s, blocks", "step s, layers", "layers / blocks", "final loss"], rows)
    text += (
        f"\n\nLlama 4 x 256 (peers.py's), sequence {SEQ}, micro-batch {MICRO}, fp32, 2 processes (gloo), {a.steps} "
        f"steps; each run's median step after the fifth, {a.repeats} alternating rounds."
    )
    record("ZeRO-3 block by block against layer by layer", text)


if __name__ == "__main__":
    sys.exit(main())
