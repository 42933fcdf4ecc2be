"""A user's samples that do not become a batch (images of two sizes, a PIL image torch's default_collate cannot
stack, a file the dataset cannot open), said in one line naming what to fix, as the first step's errors of the
model and the loss are, where a DataLoader's traceback (and a worker's inside it) was printed."""

import re
import traceback
from collections.abc import Iterator

from distsetup.errors import DistsetupError, first_line, last_line
from distsetup.training import user_code

# A frame of the traceback a DataLoader worker's error carries as text: File "/path/x.py", line 3, in name
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')
# The DataLoader's fetch calling the collate function (torch/utils/data/_utils/fetch.py: `return
# self.collate_fn(data)`), in a traceback's text: the error came from collating, not from the dataset's samples
_COLLATE_CALL = re.compile(r'fetch\.py", line \d+, in fetch\n\s*return self\.collate_fn\(')


def said_in_one_line(batches: Iterator, collating: str) -> Iterator:
    """The batches of `batches`; an error fetching or collating one said in one line (`collating`: what batches the
    samples, "data.collate mine:batch" or torch's default_collate)."""
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except DistsetupError:
            raise
        except Exception as e:
            raise DistsetupError(*problem(e, collating)) from e
        yield batch


def problem(error: Exception, collating: str) -> tuple[str, str]:
    """(what happened, the fix) for `error`, raised in this process or in a DataLoader worker (which re-raises it
    here with the worker's traceback as its message)."""
    text = str(error)
    if text.startswith("DataLoader worker"):  # "(pid 123) is killed by signal: Killed": no sample's fault
        return (
            f"a DataLoader worker of this rank stopped: {first_line(error)}.",
            "a worker killed by the system ran out of memory (dmesg says): lower data.num_workers or the samples' "
            "size, or set data.num_workers: 0.",
        )
    in_worker = "Original Traceback" in text
    what = f"{last_line(error)}{_where_in_worker(text)}" if in_worker else user_code.what_raised(error)
    if _COLLATE_CALL.search(text if in_worker else _traceback_text(error)):
        return (
            f"the samples of a micro-batch do not make a batch by {collating}: {what}.",
            "make each sample's tensors the same shape and kind in every sample (an image as a tensor of one size), "
            "or set data.collate to a function that batches them.",
        )
    return (
        f"data.builder's dataset raised {what} as its samples were read.",
        "fix the dataset's __getitem__ (or its data.args).",
    )


def _traceback_text(error: BaseException) -> str:
    return "".join(traceback.format_tb(error.__traceback__))


def _where_in_worker(text: str) -> str:
    """' (at dataset.py:12, in __getitem__)': the innermost frame of the user's own code in a worker's traceback."""
    return user_code.innermost_users_frame((m["file"], m["line"], m["name"]) for m in _FRAME.finditer(text))
