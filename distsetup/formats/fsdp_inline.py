"""FSDP settings written inline in a run config, under `distributed:` in the guides' spelling (fsdp_* keys with
lowercase values, the precision as fsdp_mixed_precision + fsdp_param_dtype): read into the file's keys and values,
then judged by the file's rules and said in the run config's keys."""

import json

from distsetup.formats.fsdp import BACKWARD_PREFETCH, SHARDING_STRATEGIES, STATE_DICT_TYPES, TRANSFORMER
from distsetup.formats.fsdp_rules import fsdp_findings
from distsetup.formats.problems import Problem

# The guides' spelling of FSDP settings written inline under `distributed:` (lowercase values, the precision as
# fsdp_mixed_precision + fsdp_param_dtype) -> the file's values. Every other fsdp_* key is the file's own.
INLINE_VALUES = {
    "fsdp_auto_wrap_policy": {
        "transformer_auto_wrap": TRANSFORMER,
        "transformer_based_wrap": TRANSFORMER,
        "size_based_wrap": "SIZE_BASED_WRAP",
        "size_based_auto_wrap": "SIZE_BASED_WRAP",
        "no_wrap": "NO_WRAP",
    },
    "fsdp_sharding_strategy": {s.lower(): s for s in SHARDING_STRATEGIES},
    "fsdp_state_dict_type": {s.lower(): s for s in STATE_DICT_TYPES},
    "fsdp_backward_prefetch": {s.lower(): s for s in BACKWARD_PREFETCH},
}
INLINE_PRECISION = ("fsdp_mixed_precision", "fsdp_param_dtype")
PARAM_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "float32": "no"}


def read_inline(distributed: dict) -> tuple[dict, list[str], list[Problem]]:
    """The FSDP settings written inline under `distributed:` (fsdp_* keys but fsdp_config), taken out of it and
    returned in the file's keys and values, with a note for each value read in another spelling and the problems
    of the precision keys. The file's rules (fsdp_findings) then judge the result."""
    inline = {k: distributed.pop(k) for k in list(distributed) if k.startswith("fsdp_") and k != "fsdp_config"}
    block, notes, problems = {}, [], []
    for key, value in inline.items():
        if key in INLINE_PRECISION:
            continue
        spelled = INLINE_VALUES.get(key, {}).get(value.lower()) if isinstance(value, str) else None
        if spelled is not None and spelled != value:
            notes.append(f"distributed.{key} {value!r} is read as {spelled} (the FSDP file's spelling).")
        block[key] = spelled or value
    mixed, dtype = (inline.get(k) for k in INLINE_PRECISION)
    if mixed is not None or dtype is not None:
        if dtype is not None and not (isinstance(dtype, str) and dtype.lower() in PARAM_DTYPES):
            problems.append(
                Problem("distributed.fsdp_param_dtype", f"{dtype!r} is not a dtype.", "write bfloat16 or float16.")
            )
        elif mixed is not None and not isinstance(mixed, bool):
            problems.append(
                Problem("distributed.fsdp_mixed_precision", f"{mixed!r} is not true or false.", "write true or false.")
            )
        elif mixed is True and dtype is None:
            problems.append(
                Problem(
                    "distributed.fsdp_mixed_precision",
                    "true, but no fsdp_param_dtype says which precision.",
                    "add fsdp_param_dtype: bfloat16 (or float16).",
                )
            )
        else:
            precision = "no" if mixed is False or dtype is None else PARAM_DTYPES[dtype.lower()]
            block["mixed_precision"] = precision
            said = " and ".join(f"distributed.{k} {json.dumps(inline[k])}" for k in INLINE_PRECISION if k in inline)
            notes.append(f"{said}: read as the FSDP file's mixed_precision {precision}.")
    return block, notes, problems


def inline_findings(block: dict) -> tuple[list[Problem], list[str]]:
    """fsdp_findings of settings written inline, said in the run config's keys."""
    problems, notes = fsdp_findings(block, inline=True)
    where = {"mixed_precision": "distributed.fsdp_mixed_precision"}
    return [Problem(where.get(p.path, f"distributed.{p.path}".rstrip(".")), p.message, p.fix) for p in problems], [
        f"distributed.{note}" for note in notes
    ]
