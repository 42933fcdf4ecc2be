"""Training and validation data, and the order ranks read it in: a synthetic task, the user's files as
memory-mapped token files (token_files.py), or the user's own map-style datasets (data.type python)."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from distsetup.errors import DistsetupError, first_line
from distsetup.formats.batch import global_batch_of
from distsetup.formats.runconfig import TOKEN_SUFFIX, RunConfig
from distsetup.training import user_code
from distsetup.training.data.samples import SampleEncoder
from distsetup.training.data.token_files import MappedBlocks, cached_tokens, check_ids, open_token_file
from distsetup.training.data.tokenizer import check_vocabulary, load_tokenizer, stop_mismatch
from distsetup.training.model.build import embedding_rows, end_of_sequence_ids
from distsetup.training.world import decided_by_rank0


def synthetic_dataset(num_samples: int, block_size: int, vocab_size: int, seed: int) -> torch.Tensor:
    """Arithmetic sequences mod vocab_size from a random start and a random stride (1-8).

    The stride is visible from the first two tokens, so a model learns to predict everything after
    them: the loss falls from ln(vocab_size) towards zero within a few hundred steps.
    """
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (num_samples, 1), generator=g)
    stride = torch.randint(1, 9, (num_samples, 1), generator=g)
    return (start + stride * torch.arange(block_size + 1)) % vocab_size


IGNORE = -100  # the target of an id that carries no loss (F.cross_entropy's ignore_index)


class TokenBlocks:
    """Samples of block_size + 1 token ids (in memory, or memory-mapped token files) and, for instruction data,
    which ids count in the loss. A batch is each block's first block_size ids as the input and its last block_size
    as the targets, IGNORE where an id does not count."""

    def __init__(self, tokens: "np.ndarray | MappedBlocks", loss: "np.ndarray | MappedBlocks | None" = None):
        self.tokens, self.loss = tokens, loss

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def masked(self) -> bool:
        """Whether some targets carry no loss (so micro-batches hold different numbers of counted targets)."""
        return self.loss is not None

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch([index])
        return x[0], y[0]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of `indices`, read at once (what a DataLoader asks a dataset that has this for)."""
        return self.batch(indices)

    def batch(self, idx) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.asarray(idx)
        blocks = torch.from_numpy(self.tokens[rows].astype(np.int64))
        x, y = blocks[:, :-1], blocks[:, 1:].clone()
        if self.loss is not None:
            y[torch.from_numpy(self.loss[rows][:, 1:] == 0)] = IGNORE
        return x, y


def loss_weights(targets: list[torch.Tensor], world_size: int, device: torch.device) -> torch.Tensor:
    """Each micro-batch's loss weight for a step whose micro-batches count different numbers of targets
    (instruction data): the backends average the micro-batches' mean losses over micro-batches and ranks, which
    would weigh a micro-batch of 3 counted targets as much as one of 300; weighted, the step's loss (and gradient)
    is the mean over every counted target of the step, on every rank. One all-reduce of a number per step.

    A float64 tensor [micro-batches] on `device`, never read back: on a GPU the host queues the step's work without
    waiting for these counts."""
    counted = torch.stack([(y != IGNORE).sum() for y in targets]).double().to(device)
    total = counted.sum()
    if dist.is_initialized():
        dist.all_reduce(total)
    return counted * (len(targets) * world_size) / total


def as_fetched(batch):
    """The collate function of TokenBlocks: its __getitems__ returns the batch whole."""
    return batch


@dataclass(frozen=True)
class Datasets:
    train: Any  # a map-style dataset: TokenBlocks, or the user's
    val: Any | None
    notes: list[str]  # what rank 0 says about them (a cache built or rebuilt)
    collate: Callable = as_fetched  # samples -> a batch
    collating: str | None = None  # the user's samples: what batches them (said where they do not make a batch)

    @property
    def tokens(self) -> bool:
        """Whether the samples are token blocks (the token objective's (input ids, targets) batches)."""
        return isinstance(self.train, TokenBlocks)


def build_datasets(cfg: RunConfig, ranks: int) -> Datasets:
    """The training and validation datasets of the run config `cfg`: the synthetic task in memory, token files
    memory-mapped (the user's, or the cache rank 0 tokenizes text into while the other ranks wait), or the user's.
    `ranks`: the processes that evaluate the validation set, a share each (the fewest samples it may hold)."""
    m, d, t = cfg.model, cfg.data, cfg.training
    if d.type == "python":
        datasets = python_datasets(d, t.seed)
    elif d.type == "synthetic":
        train = synthetic_dataset(d.num_samples, m.block_size, m.vocab_size, t.seed)
        held_out = round(d.num_samples * d.val_fraction)
        val = synthetic_dataset(held_out, m.block_size, m.vocab_size, t.seed + 1) if held_out else None
        datasets = Datasets(TokenBlocks(train.numpy()), None if val is None else TokenBlocks(val.numpy()), [])
    else:
        files = decided_by_rank0(lambda: prepared_token_files(cfg), patient=True)
        opened = {
            split: open_token_file(Path(path), m.block_size + 1, files["tokenizer"], setting)
            for split, (path, setting) in files["splits"].items()
        }
        blocks = {split: TokenBlocks(f.tokens, f.loss) for split, f in opened.items()}
        datasets = Datasets(blocks["train"], blocks.get("val"), files["notes"])
    _check_sizes(datasets, cfg, ranks)
    return datasets


def python_datasets(d, seed: int) -> Datasets:
    """data.builder("train", **data.args) and ("val", ...), each a map-style dataset (None for "val": none), collated
    by data.collate or torch's default_collate. torch's, numpy's and Python's random generators are seeded with
    `seed` first: a builder that draws (a random split) builds the same datasets on every rank and every resume."""
    import random

    from torch.utils.data import IterableDataset, default_collate

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    builder = user_code.load(d.builder, "data.builder")
    user_code.check_takes(builder, "data.builder", "train", **d.args)
    collate = user_code.load(d.collate, "data.collate") if d.collate else default_collate
    splits = {}
    for split in ("train", "val"):
        try:
            dataset = builder(split, **d.args)
        except DistsetupError:
            raise
        except Exception as e:
            raise DistsetupError(
                f"data.builder {d.builder} raised {type(e).__name__} for split {split!r}: {first_line(e)}"
                f"{user_code.raised_in_user_code(e)}.",
                f"fix {d.builder} or data.args.",
            ) from None
        if isinstance(dataset, Mapping) and not all(isinstance(key, int) for key in dataset):  # columns, splits
            raise DistsetupError(
                f"data.builder {d.builder} returned a {type(dataset).__name__} for split {split!r}, a mapping: no "
                f"dataset of samples (its length is its {len(dataset)} keys').",
                "return one sample per index: a list of dicts, torch.utils.data.TensorDataset(*columns), or a "
                "DatasetDict's split (dataset[split]).",
            )
        map_style = hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
        if (dataset is None and split == "val") or (map_style and not isinstance(dataset, IterableDataset)):
            splits[split] = dataset
            continue
        raise DistsetupError(
            f"data.builder {d.builder} returned {type(dataset).__name__} for split {split!r}, not a map-style "
            "dataset (one with __len__ and __getitem__: the sampler picks samples by index).",
            "return a torch.utils.data.Dataset with __len__ (or a list); None for 'val' means no validation.",
        )
    collating = f"data.collate {d.collate}" if d.collate else "torch's default_collate (data.collate unset)"
    return Datasets(splits["train"], splits["val"], [], collate, collating)


def prepared_token_files(cfg: RunConfig) -> dict:
    """Rank 0: the token files of each split, checked against the run's tokenizer and model, text tokenized into
    the cache first; {"splits": {split: (path, setting)}, "tokenizer": fingerprint, "notes": [...]}."""
    m, d, t = cfg.model, cfg.data, cfg.training
    tokenizer = load_tokenizer(m.tokenizer)
    if d.format == "chat" and not tokenizer.has_chat_template:
        raise DistsetupError(
            f"data.format chat needs a chat template; model.tokenizer {m.tokenizer} has none.",
            "use a tokenizer folder whose tokenizer_config.json (or chat_template.jinja) holds one.",
        )
    if d.format == "chat" and not tokenizer.has_offsets:
        raise DistsetupError(
            f"data.format chat marks the assistant's tokens by their place in the text, which only a fast "
            f"tokenizer says; model.tokenizer {m.tokenizer} is a slow one.",
            "save the tokenizer with its tokenizer.json (a fast tokenizer).",
        )
    rows, where = embedding_rows(m)
    check_vocabulary(tokenizer, rows, where)
    width = m.block_size + 1
    if d.paths[0].endswith(TOKEN_SUFFIX):
        splits = {"train": (d.paths[0], "data.paths[0]")}
        if d.val_paths:
            splits["val"] = (d.val_paths[0], "data.val_paths[0]")
        blocks = {}
        for split, (path, setting) in splits.items():
            opened = open_token_file(Path(path), width, tokenizer.fingerprint, setting)
            check_ids(opened, Path(path), rows, where)
            blocks[split] = len(opened.tokens)
        notes = [blocks_line(blocks, width, "(pre-tokenized)")]
        return {"splits": splits, "tokenizer": tokenizer.fingerprint, "notes": notes}
    cache_dir = Path(d.cache_dir) if d.cache_dir else Path(t.output_dir) / "token_cache"
    folder, counts, rebuilt = cached_tokens(d, tokenizer, width, t.seed, cache_dir)
    if counts["train"]["blocks"] == 0:
        raise DistsetupError(f"data.paths hold no whole block of {width} ids.", "add data or lower model.block_size.")
    if counts.get("val", {"blocks": 1})["blocks"] == 0:
        raise DistsetupError(
            "the validation split is empty"
            + (f": data.val_fraction {d.val_fraction} drew no sample." if not d.val_paths else "."),
            "add data to data.val_paths."
            if d.val_paths
            else "raise data.val_fraction, or name validation files in data.val_paths.",
        )
    splits = {split: (str(folder / f"{split}.bin"), f"the token cache's {split}.bin") for split in counts}
    cut = sum(c["truncated"] for c in counts.values())
    left_out = sum(c["dropped"] for c in counts.values())
    notes = [rebuilt] if rebuilt else []
    stops = end_of_sequence_ids(m)
    end = SampleEncoder(tokenizer, d).sample_end() if stops else None
    stop_note = stop_mismatch(tokenizer, end, *stops) if stops and end else None
    notes.append(blocks_line({split: c["blocks"] for split, c in counts.items()}, width, f"in {folder}"))
    if cut or left_out:
        notes.append(f"data: {cut} samples cut to a block's length, {left_out} left out (no target left to learn)")
    return {"splits": splits, "tokenizer": tokenizer.fingerprint, "notes": notes + ([stop_note] if stop_note else [])}


def blocks_line(blocks: dict[str, int], width: int, where: str) -> str:
    """'data: 120 train blocks, 3 val blocks of 33 ids in FOLDER': what a run reads of its token data."""
    sizes = ", ".join(f"{count} {split} block{'s' if count != 1 else ''}" for split, count in blocks.items())
    return f"data: {sizes} of {width} ids {where}"


def _check_sizes(datasets: Datasets, cfg: RunConfig, ranks: int) -> None:
    """A validation set gives each rank a sample at least (a share shorter than a micro-batch is evaluated as it is:
    loader.validation_batches); the training set, one global batch (ShardedSampler)."""
    d, t = cfg.data, cfg.training
    if d.type == "python":
        source, items, fix = 'data.builder("val")', "samples", "add validation samples"
    else:
        source = "data.val_paths" if d.val_paths else f"data.val_fraction {d.val_fraction}"
        items = "blocks"
        fix = "add validation data to data.val_paths" if d.val_paths else "raise data.val_fraction, or add data"
    if datasets.val is not None and len(datasets.val) < ranks:
        count = len(datasets.val)
        raise DistsetupError(
            f"the validation set ({source}) has {count} {items if count != 1 else items[:-1]}, fewer than the "
            f"{ranks} processes that evaluate it (a share of one at least each).",
            f"{fix}, or train on fewer processes.",
        )
    if datasets.val is None and t.eval_interval and d.type == "python":
        raise DistsetupError(
            f"training.eval_interval is set, but data.builder {d.builder} returned None for 'val'.",
            "return a validation dataset for 'val', or drop training.eval_interval.",
        )


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
        self.global_batch = global_batch_of(micro_batch, accumulation, world_size)
        if num_samples < self.global_batch:
            raise DistsetupError(
                f"the dataset has {num_samples} samples, fewer than one global batch of {self.global_batch}.",
                "add data or lower the batch size.",
                alike_on_every_rank=True,  # the same data and batch on every rank
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

    def steps_until_end_of_epoch(self, epochs: int) -> int:
        """The optimizer steps from its position until `epochs` passes over the samples are done (0 where they
        are): the rest of this epoch, then whole ones."""
        if self.epoch >= epochs:
            return 0
        left_in_this_one = max(self.num_samples - self.position, 0) // self.global_batch  # fewer samples now: none
        return left_in_this_one + (epochs - self.epoch - 1) * (self.num_samples // self.global_batch)

    def next_step(self) -> list[torch.Tensor]:
        """This rank's sample indices for each micro-batch of the next optimizer step."""
        if self.position + self.global_batch > self.num_samples:
            self.set_epoch(self.epoch + 1)
            self.position = 0
        if self._order is None:
            self._order = torch.randperm(  # int32 where it fits: the same order in half the memory
                self.num_samples,
                generator=torch.Generator().manual_seed(self.seed + self.epoch),
                dtype=torch.int32 if self.num_samples < 2**31 else torch.int64,
            )
        chunk = self._order[self.position : self.position + self.global_batch]
        self.position += self.global_batch
        return [chunk[(m * self.world + self.rank) * self.micro :][: self.micro] for m in range(self.accumulation)]
