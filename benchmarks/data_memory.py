"""Benchmark: peak memory (RSS) of one rank reading its training data, for corpora of 10 MB, 100 MB and 1 GB of
JSONL text generated here (byte-level tokens, so the corpus's bytes are its tokens).

distsetup tokenizes a corpus once into its token cache (uint16 ids) and every rank memory-maps it; before that,
every rank read the whole corpus into memory as int64 (8 bytes a token), which is measured beside it for every
size this machine can hold. Each rank is its own process that reads the data as the trainer's ranks do (the
ShardedSampler's order, --steps batches of its shard) after importing torch and distsetup; the table gives the
larger peak of the two ranks of a 2-rank world. Goal: the token cache's peak flat within 10% from 10 MB to 1 GB.
"""

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import record, table

SIZES = {"10 MB": 10 * 10**6, "100 MB": 100 * 10**6, "1 GB": 10**9}
WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this be or had not but "
    "what all when we there can been has if more one so no out up into do only new time could other than then "
    "model data train rank batch token shard memory disk corpus"
).split()
BLOCK, MICRO, WORLD = 256, 8, 2


def write_corpus(path: Path, size: int) -> None:
    """JSONL records of about 1 kB of words until `size` bytes."""
    draw = random.Random(0)
    lines = [json.dumps({"text": " ".join(draw.choices(WORDS, k=190))}) + "\n" for _ in range(1000)]
    written = 0
    with path.open("w") as f:
        while written < size:
            line = lines[draw.randrange(len(lines))]
            f.write(line)
            written += len(line)


def run_config(corpus: Path, cache: Path):
    from distsetup.formats.runconfig import DataConfig, ModelConfig, RunConfig, TrainingConfig

    return RunConfig(
        model=ModelConfig(vocab_size=256, block_size=BLOCK),
        data=DataConfig(type="files", paths=[str(corpus)], cache_dir=str(cache)),
        training=TrainingConfig(micro_batch_size=MICRO, output_dir=str(cache.parent / "out")),
    )


def measure(mode: str, corpus: Path, cache: Path, rank: int, steps: int) -> None:
    """One rank: read the data as `mode` does, take `steps` batches; print the peak RSS in bytes."""
    import torch

    from distsetup.training.data.datasets import ShardedSampler, TokenBlocks, build_datasets

    if mode == "token cache":
        blocks = build_datasets(run_config(corpus, cache), eval_batch=MICRO * WORLD).train
    else:  # what every rank did before the token cache: the whole corpus as int64 tensors
        text = "\n".join(json.loads(line)["text"] for line in corpus.open())
        tokens = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).long()
        del text
        samples = len(tokens) // (BLOCK + 1)
        blocks = TokenBlocks(tokens[: samples * (BLOCK + 1)].view(samples, BLOCK + 1).numpy())
    sampler = ShardedSampler(len(blocks), MICRO, 1, WORLD, rank, seed=0)
    for _ in range(steps):
        for idx in sampler.next_step():
            x, y = blocks.batch(idx)
            assert x.shape == (MICRO, BLOCK)
    # VmHWM: this process's own peak (getrusage's ru_maxrss would carry the launching process's peak over exec)
    status = Path("/proc/self/status").read_text()
    print(next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")))


def peak_of_ranks(mode: str, corpus: Path, cache: Path, steps: int) -> int:
    peaks = []
    for rank in range(WORLD):
        argv = [sys.executable, __file__, "--measure", mode, "--corpus", corpus, "--cache", cache, "--rank", rank]
        result = subprocess.run([str(a) for a in argv + ["--steps", steps]], capture_output=True, text=True, check=True)
        peaks.append(int(result.stdout.split()[-1]))
    return max(peaks)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, help="folder for the corpora and caches (default: a temp folder)")
    parser.add_argument("--steps", type=int, default=200, help="batches each rank reads")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--in_memory_up_to", default="1 GB", choices=list(SIZES), help="largest in-memory size")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.measure:
        measure(a.measure, a.corpus, a.cache, a.rank, a.steps)
        return

    work = a.work or Path(tempfile.mkdtemp(prefix="bench-data-"))
    rows, cached_peaks = [], []
    for name in a.sizes:
        corpus, cache = work / f"corpus-{SIZES[name]}.jsonl", work / f"cache-{SIZES[name]}"
        if not corpus.exists():
            write_corpus(corpus, SIZES[name])
        shutil.rmtree(cache, ignore_errors=True)
        began = time.perf_counter()
        from distsetup.training.data.datasets import build_datasets

        build_datasets(run_config(corpus, cache), eval_batch=MICRO * WORLD)  # rank 0 tokenizes it once
        tokenize_s = time.perf_counter() - began
        cached = peak_of_ranks("token cache", corpus, cache, a.steps)
        cached_peaks.append(cached)
        in_memory = None
        if SIZES[name] <= SIZES[a.in_memory_up_to]:
            in_memory = peak_of_ranks("in memory", corpus, cache, a.steps)
        rows.append(
            [
                name,
                f"{corpus.stat().st_size / 1e6:.0f}",
                f"{cached / 2**20:.0f}",
                "-" if in_memory is None else f"{in_memory / 2**20:.0f}",
                "-" if in_memory is None else f"{in_memory / cached:.2f}x",
                f"{tokenize_s:.1f}",
            ]
        )
    growth = max(cached_peaks) / min(cached_peaks) - 1
    text = table(
        ["corpus", "MB", "token cache: peak RSS MiB", "in memory (before): MiB", "in memory / cache", "tokenize s"],
        rows,
    )
    text += (
        f"\n\nPeak RSS of one rank (the larger of 2 ranks), torch and distsetup imported, {a.steps} batches of "
        f"{MICRO} x {BLOCK} tokens read in the sampler's order; byte-level tokens, so a corpus of N bytes is N "
        f"tokens (the cache holds them as uint16, the in-memory reading as int64). The token cache's peak grows "
        f"{growth:.1%} from the smallest corpus to the largest (goal: within 10%: "
        f"{'met' if growth <= 0.10 else 'NOT met'}). 'tokenize s': rank 0 building the cache (byte-level; the "
        "first row includes importing datasets)."
    )
    record("Data memory per rank", text)


if __name__ == "__main__":
    sys.exit(main())
