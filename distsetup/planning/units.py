"""Sizes as people write them: parameter counts (7B, 350M, 1.3e9) and amounts of memory (80GB, 24GiB), with the
bounds beyond which a value is a typo, and GB for display."""

import math
import re

from distsetup.errors import DistsetupError

GB = 1e9
SUFFIXES = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_DECIMAL = {prefix: SUFFIXES[prefix] for prefix in "KMGT"}
_BINARY = {prefix: 2 ** (10 * (power + 1)) for power, prefix in enumerate("KMGT")}
# 80GB, 80G (as Kubernetes and SLURM users write it), 80GiB, 80Gi; a bare number is GB
MEMORY_UNITS = {
    "": GB,
    "B": 1,
    **{f"{prefix}{unit}": size for prefix, size in _DECIMAL.items() for unit in ("", "B")},
    **{f"{prefix}{unit}": size for prefix, size in _BINARY.items() for unit in ("I", "IB")},
}
MAX_PARAMS = 10**15  # a thousand times the largest models: beyond it, a typo
MAX_MEMORY = 64e12  # bytes: a GPU has under 300 GB, the largest nodes a few TB; more is a typo (80TB for 80GB)
MAX_BATCH = 10**9  # samples per step: more is a typo (and overflows the activation arithmetic)


def _number(text: str) -> float | None:
    """A finite number from the digits of a size, or None ('1.2.3', '1e999')."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_count(text: str, flag: str = "--params") -> int:
    """'7B', '1.3e9', '350M' -> a parameter count, at least 1 and at most MAX_PARAMS."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([KMBGT]?)\s*", str(text), re.IGNORECASE)
    value = _number(match.group(1)) if match else None
    if match is None or value is None:
        raise DistsetupError(f"{flag}: cannot read '{text}' as a parameter count.", "write e.g. 7B, 350M or 1.3e9.")
    count = int(value * SUFFIXES[match.group(2).upper()])
    if not 1 <= count <= MAX_PARAMS:
        raise DistsetupError(
            f"{flag} {text} is {count:,} parameters.",
            f"give a count from 1 to {MAX_PARAMS:.0e} (the largest models have about 2e12).",
        )
    return count


def parse_memory(text: str, flag: str = "--gpu_memory") -> float:
    """'80GB', '80G', '80GiB', '80Gi', '80' (GB) -> bytes, more than none."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?I?B?)\s*", str(text), re.IGNORECASE)
    value = _number(match.group(1)) if match and match.group(2).upper() in MEMORY_UNITS else None
    if match is None or value is None:
        raise DistsetupError(f"{flag}: cannot read '{text}' as an amount of memory.", "write e.g. 80GB or 24GiB.")
    if value <= 0:
        raise DistsetupError(f"{flag} {text} is no memory at all.", "give the memory of one device, e.g. 80GB.")
    size = value * MEMORY_UNITS[match.group(2).upper()]
    if size > MAX_MEMORY:
        raise DistsetupError(
            f"{flag} {text} is more than any machine has ({MAX_MEMORY / 1e12:.0f} TB at most).",
            "give the memory of one device or node, e.g. 80GB.",
        )
    return size


def in_words(params: float) -> str:
    """A parameter count as people say it: 350M, 7B, 1.3B, 1000B (not 1e+03B), 20T."""
    scale, unit = (1e6, "M") if params < 1e9 else (1e9, "B") if params < 1e13 else (1e12, "T")
    value = params / scale
    return f"{value:.3g}{unit}" if value < 1000 else f"{value:.0f}{unit}"


def gb(value: float) -> str:
    return f"{value / GB:.1f}"
