"""Training data and the order ranks read it in: a synthetic task or byte-level text files."""

import json
from pathlib import Path

import torch

from distsetup.errors import DistsetupError


def synthetic_dataset(num_samples: int, block_size: int, vocab_size: int, seed: int) -> torch.Tensor:
    """Arithmetic sequences mod vocab_size from a random start and a random stride (1-8).

    The stride is visible from the first two tokens, so a model learns to predict everything after
    them: the loss falls from ln(vocab_size) towards zero within a few hundred steps.
    """
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (num_samples, 1), generator=g)
    stride = torch.randint(1, 9, (num_samples, 1), generator=g)
    return (start + stride * torch.arange(block_size + 1)) % vocab_size


def file_dataset(paths: list[str], block_size: int, vocab_size: int) -> torch.Tensor:
    """Text files (or JSONL with a "text" field) as bytes, cut into windows of block_size + 1 tokens."""
    if vocab_size < 256:
        raise DistsetupError(
            f"byte-level text needs model.vocab_size >= 256, not {vocab_size}.", "set model.vocab_size: 256."
        )
    chunks = []
    for name in paths:
        path = Path(name)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DistsetupError(f"cannot read data file {path}: {e}.", "check data.paths.")
        if path.suffix == ".jsonl":
            text = "\n".join(_jsonl_texts(path, text))
        if not text:
            raise DistsetupError(f"data file {path} is empty.", "add text to it or remove it from data.paths.")
        chunks.append(text.encode("utf-8"))
    corpus = b"\n".join(chunks)
    n = len(corpus) // (block_size + 1)
    if n == 0:
        raise DistsetupError(
            f"data.paths hold {len(corpus)} bytes, fewer than one sample of {block_size + 1}.",
            "add text or lower model.block_size.",
        )
    tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
    return tokens[: n * (block_size + 1)].view(n, block_size + 1)


def _jsonl_texts(path: Path, text: str):
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)["text"]
            except (ValueError, KeyError, TypeError):
                raise DistsetupError(
                    f"{path}:{number} is not a JSON object with a 'text' field.",
                    'write one {"text": ...} object per line.',
                )


def build_dataset(cfg) -> torch.Tensor:
    m, d = cfg.model, cfg.data
    if d.type == "synthetic":
        return synthetic_dataset(d.num_samples, m.block_size, m.vocab_size, cfg.training.seed)
    return file_dataset(d.paths, m.block_size, m.vocab_size)


class ShardedSampler:
    """Which samples each rank reads, step by step; like DistributedSampler, but resumable mid-epoch.

    Each epoch is a fresh permutation of the samples, a function of the seed and the epoch alone; every optimizer
    step takes the next `global_batch` samples of it, and rank r's micro-batch m is slice (m * world + r) of that
    chunk. Ranks never share a sample, and the position is counted in samples: a run resumed with the same global
    batch split otherwise (other world size, micro-batch or accumulation) reads what the uninterrupted run would
    have, and one with another global batch continues from the same sample. An epoch ends where the samples left
    no longer fill a global batch.
    """

    def __init__(self, num_samples: int, micro_batch: int, accumulation: int, world_size: int, rank: int, seed: int):
        self.micro, self.accumulation, self.world, self.rank, self.seed = (
            micro_batch,
            accumulation,
            world_size,
            rank,
            seed,
        )
        self.global_batch = micro_batch * accumulation * world_size
        if num_samples < self.global_batch:
            raise DistsetupError(
                f"the dataset has {num_samples} samples, fewer than one global batch of {self.global_batch}.",
                "add data or lower the batch size.",
            )
        self.num_samples = num_samples
        self.epoch, self.position = 0, 0  # position: samples of this epoch's order already read
        self._order: torch.Tensor | None = None  # this epoch's permutation, drawn when first needed

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._order = epoch, None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "samples": self.position, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the sample where `state` stopped (older checkpoints counted optimizer steps of their own
        global batch)."""
        self.set_epoch(state["epoch"])
        self.position = state["samples"] if "samples" in state else state["position"] * state["global_batch"]

    def next_step(self) -> list[torch.Tensor]:
        """This rank's sample indices for each micro-batch of the next optimizer step."""
        if self.position + self.global_batch > self.num_samples:
            self.set_epoch(self.epoch + 1)
            self.position = 0
        if self._order is None:
            self._order = torch.randperm(
                self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch)
            )
        chunk = self._order[self.position : self.position + self.global_batch]
        self.position += self.global_batch
        return [chunk[(m * self.world + self.rank) * self.micro :][: self.micro] for m in range(self.accumulation)]
