"""Token files, what the trainer reads memory-mapped (a rank's memory does not grow with the corpus), and the cache
that tokenizes text into them once.

A token file is nanoGPT's flat layout: `<name>.bin` holds token ids one after the other (uint16 where the
vocabulary fits, else uint32), read as blocks of block_size + 1 ids; its sidecar `<name>.bin.json` names the dtype,
the tokenizer (its fingerprint, tokenizer.py) and the vocabulary size. Instruction data adds `<name>.mask.bin`, one
byte per id: 1 where predicting that id counts in the loss.

How samples become blocks (the README's "Truncation, packing and padding"):
- text: documents are concatenated and cut into blocks; a document runs on into the next block; the last ids
  that do not fill a block are left out.
- prompt_completion and chat: each sample stays whole in one block. A sample longer than a block is cut to the
  block's length (its end goes); one with nothing left that carries loss is left out. Samples are packed in
  order: one that does not fit in the rest of the block starts the next, and the rest is padded with EOS
  ids (0 for a tokenizer without EOS) that carry no loss.

The cache (`data.cache_dir`, one folder per key: the files' paths, sizes and times, the tokenizer, the format and
its fields, the block size and the validation split) is written by rank 0 in a hidden folder renamed when whole;
the other ranks wait, then map it. A folder whose files are missing, truncated or unreadable is rebuilt.
"""

import fcntl
import hashlib
import json
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from distsetup.errors import DistsetupError
from distsetup.training.data.samples import Sample, SampleEncoder
from distsetup.training.staged_folders import as_a_new_folder

CACHE_VERSION = 2
MARKER = "cache.json"  # written last: a folder without it is unfinished
FLUSH_IDS = 1 << 20  # text: ids gathered before whole blocks are written out


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def mask_file(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".bin") + ".mask.bin")


@dataclass(frozen=True)
class MappedBlocks:
    """A file of blocks, memory-mapped only while rows are read: the pages a batch touched leave this process with
    it. (A mapping kept open holds every page the run has read, up to the whole corpus: nanoGPT maps its .bin
    anew for each batch for this reason.)"""

    path: Path
    dtype: np.dtype
    shape: tuple[int, int]

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows) -> np.ndarray:
        return np.array(self._mapped()[rows])  # a copy; the mapping goes with this call

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.array(self._mapped(), dtype=dtype)

    def _mapped(self) -> np.memmap:
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=self.shape)


@dataclass(frozen=True)
class TokenFile:
    """A token file as blocks: `tokens` (blocks x width ids), `loss` (the same shape, 1 where an id counts in the
    loss; None: every id counts)."""

    tokens: MappedBlocks
    loss: MappedBlocks | None


class BlockWriter:
    """Samples into the blocks of token file `path` (each `width` ids), as the module docstring says."""

    def __init__(self, path: Path, width: int, dtype: np.dtype, masked: bool, pad_id: int):
        self.path, self.width, self.dtype, self.pad_id = path, width, dtype, pad_id
        self.tokens = open(path, "wb")
        self.loss = open(mask_file(path), "wb") if masked else None
        self.ids: list[np.ndarray] = []  # what waits to fill a block
        self.counts: list[np.ndarray] = []
        self.waiting = 0
        self.blocks = self.truncated = self.dropped = 0

    def add(self, sample: Sample) -> None:
        if self.loss is None:
            self.ids.append(sample.ids)
            self.waiting += len(sample.ids)
            if self.waiting >= FLUSH_IDS:
                self._write_whole_blocks()
            return
        assert sample.loss is not None  # instruction formats mark their loss
        ids, counts = sample.ids[: self.width], sample.loss[: self.width]
        self.truncated += len(sample.ids) > self.width
        if not counts[1:].any():  # the first id of a block is never predicted
            self.dropped += 1
            return
        if self.waiting + len(ids) > self.width:
            self._write_padded_block()
        self.ids.append(ids)
        self.counts.append(counts)
        self.waiting += len(ids)

    def close(self) -> dict:
        """Writes what is left; returns the blocks written and the samples cut or left out."""
        if self.loss is None:
            self._write_whole_blocks()
        elif self.waiting:
            self._write_padded_block()
        for file in (self.tokens, self.loss):
            if file is not None:
                file.close()
        return {"blocks": self.blocks, "truncated": self.truncated, "dropped": self.dropped}

    def _write_whole_blocks(self) -> None:
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, dtype=np.int64)
        whole = len(ids) // self.width * self.width
        self.tokens.write(ids[:whole].astype(self.dtype).tobytes())
        self.blocks += whole // self.width
        self.ids, self.waiting = [ids[whole:]], len(ids) - whole

    def _write_padded_block(self) -> None:
        pad = self.width - self.waiting
        ids = np.concatenate([*self.ids, np.full(pad, self.pad_id, dtype=np.int64)])
        counts = np.concatenate([*self.counts, np.zeros(pad, dtype=bool)])
        self.tokens.write(ids.astype(self.dtype).tobytes())
        assert self.loss is not None
        self.loss.write(counts.astype(np.uint8).tobytes())
        self.blocks += 1
        self.ids, self.counts, self.waiting = [], [], 0


def write_sidecar(path: Path, tokenizer) -> None:
    description = {"dtype": dtype_for(tokenizer.vocab_size).name, "tokenizer": tokenizer.fingerprint}
    sidecar(path).write_text(json.dumps({**description, "vocab_size": tokenizer.vocab_size}, indent=2))


def tokenize(data, tokenizer, width: int, folder: Path, seed: int) -> dict:
    """data.paths (and data.val_paths, or a data.val_fraction of the records drawn with `seed`) as the token files
    train.bin and val.bin in `folder`; returns each split's counts."""
    encoder = SampleEncoder(tokenizer, data)
    splits = ["train"] + (["val"] if data.val_paths or data.val_fraction else [])
    writers = {
        name: BlockWriter(
            folder / f"{name}.bin",
            width,
            dtype_for(tokenizer.vocab_size),
            data.format != "text",
            tokenizer.eos_token_id or 0,
        )
        for name in splits
    }
    draw = random.Random(seed)
    for path in map(Path, data.paths):
        whole_file = path.suffix == ".txt"  # one document: one draw for all its pieces
        to_val = False
        for number, sample in enumerate(encoder.samples(path)):
            if number == 0 or not whole_file:
                to_val = bool(data.val_fraction) and draw.random() < data.val_fraction
            writers["val" if to_val else "train"].add(sample)
    for path in map(Path, data.val_paths):
        for sample in encoder.samples(path):
            writers["val"].add(sample)
    counts = {}
    for name, writer in writers.items():
        counts[name] = writer.close()
        write_sidecar(writer.path, tokenizer)
    return counts


def cache_key(data, tokenizer, width: int, seed: int) -> dict:
    """What a cached tokenization depends on; a change to any of it is another cache folder."""

    def described(paths):
        return [[str(Path(p).resolve()), Path(p).stat().st_size, Path(p).stat().st_mtime_ns] for p in paths]

    return {
        "version": CACHE_VERSION,
        "files": described(data.paths),
        "val_files": described(data.val_paths),
        "val_fraction": data.val_fraction,
        "seed": seed if data.val_fraction else None,
        "tokenizer": tokenizer.tokenization,
        "format": data.format,
        "fields": {key: getattr(data, key) for key in SampleEncoder.field_settings(data.format)},
        "width": width,
    }


def cached_tokens(data, tokenizer, width: int, seed: int, cache_dir: Path) -> tuple[Path, dict, str | None]:
    """The cache folder holding data's token files (built here when missing or damaged), its counts, and a note
    when it was rebuilt."""
    key = cache_key(data, tokenizer, width, seed)
    folder = cache_dir / hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{folder.name}.lock", "w") as lock:  # two runs sharing a cache: one builds it
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:  # a file system without flock (Lustre without -o flock): the rename still keeps it whole
            pass
        for stale in cache_dir.glob(f".{folder.name}-*"):  # staging left by a builder that was killed
            shutil.rmtree(stale, ignore_errors=True)
        return _found_or_built(data, tokenizer, width, seed, folder, key)


def _found_or_built(data, tokenizer, width: int, seed: int, folder: Path, key: dict) -> tuple[Path, dict, str | None]:
    problem = _damage(folder, key, width) if folder.exists() else None
    if folder.exists() and problem is None:
        return folder, json.loads((folder / MARKER).read_text())["counts"], None
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        counts = tokenize(data, tokenizer, width, staging, seed)
        (staging / MARKER).write_text(json.dumps({"key": key, "counts": counts}, indent=2))
        as_a_new_folder(staging)
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder, counts, None if problem is None else f"rebuilt the token cache {folder}: {problem}"


def _damage(folder: Path, key: dict, width: int) -> str | None:
    """What is wrong with cache folder `folder`, or None when every file is whole."""
    try:
        marker = json.loads((folder / MARKER).read_text())
        if marker["key"] != key:
            return "its cache.json describes other inputs"
        for name, counts in marker["counts"].items():
            path = folder / f"{name}.bin"
            itemsize = np.dtype(json.loads(sidecar(path).read_text())["dtype"]).itemsize
            if path.stat().st_size != counts["blocks"] * width * itemsize:
                return f"{path.name} is {path.stat().st_size} bytes, not {counts['blocks'] * width * itemsize}"
            if key["format"] != "text" and mask_file(path).stat().st_size != counts["blocks"] * width:
                return f"{mask_file(path).name} is not one byte per id"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def open_token_file(path: Path, width: int, tokenizer_fingerprint: str, setting: str) -> TokenFile:
    """Token file `path` as blocks of `width` ids, memory-mapped, after checking its sidecar against the run's
    tokenizer (`setting`: the config key that named it)."""
    try:
        described = json.loads(sidecar(path).read_text())
        dtype = np.dtype(described["dtype"])
        made_by = described["tokenizer"]
    except FileNotFoundError:
        raise DistsetupError(
            f"{setting}: {path} has no sidecar {sidecar(path).name} naming its dtype and tokenizer.",
            f'write {sidecar(path).name} as {{"dtype": "uint16", "tokenizer": "{tokenizer_fingerprint}"}} '
            "(uint32 for vocabularies over 65536 ids).",
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DistsetupError(
            f"{setting}: {sidecar(path)} does not say the file's dtype and tokenizer ({type(e).__name__}: {e}).",
            f'write it as {{"dtype": "uint16", "tokenizer": "{tokenizer_fingerprint}"}}.',
        ) from None
    if dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)):
        raise DistsetupError(f"{sidecar(path)}: dtype {dtype} is not uint16 or uint32.", "write uint16 or uint32.")
    if made_by != tokenizer_fingerprint:
        raise DistsetupError(
            f"{path} was tokenized by tokenizer {made_by}; this run's model.tokenizer is {tokenizer_fingerprint}.",
            "set model.tokenizer to the tokenizer that wrote it, or tokenize the text again from its source files.",
        )
    blocks = path.stat().st_size // dtype.itemsize // width
    if blocks == 0:
        raise DistsetupError(
            f"{setting}: {path} holds fewer ids than one block of {width}.", "add data or lower model.block_size."
        )
    loss = MappedBlocks(mask_file(path), np.dtype(np.uint8), (blocks, width)) if mask_file(path).exists() else None
    return TokenFile(MappedBlocks(path, dtype, (blocks, width)), loss)


def check_ids(file: TokenFile, path: Path, vocab_size: int, where: str) -> None:
    """Every id of a token file has a row in the model's embedding (`where`: the setting that sizes it); read in
    pieces, as a corpus may be larger than memory."""
    rows = max(1, (1 << 24) // file.tokens.shape[1])
    largest = max(int(file.tokens[i : i + rows].max()) for i in range(0, len(file.tokens), rows))
    if largest >= vocab_size:
        raise DistsetupError(
            f"{path} holds token id {largest}, beyond {where} {vocab_size}.",
            f"raise {where} to {largest + 1} or more, or tokenize with the model's tokenizer.",
        )
