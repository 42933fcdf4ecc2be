"""The one error type users can cause, said in one line with the fix. It knows nothing of Click: the CLI
(distsetup/cli/main.py) and the trainer (distsetup/train.py) each turn it into their one line and exit status."""

import os


class DistsetupError(Exception):
    """A problem with the user's input, said in one line with the fix."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None, *, alike_on_every_rank: bool = False):
        self.problem, self.hint = message, hint
        # found alike by every rank of a run (in its input: the data, the model's code, the first batch's shape), so
        # said by one rank per node (distsetup/train.py)
        self.alike_on_every_rank = alike_on_every_rank
        self.message = f"{message} HINT: {hint}" if hint else message
        super().__init__(self.message)

    def format_message(self) -> str:
        return self.message


def refuse_arguments_not_in_utf8(args: list[str]) -> None:
    """A byte that is not UTF-8 in an argument (Python keeps it as a lone surrogate) ended a command in a traceback
    where the value reached a script, a JSON or a YAML file, all UTF-8: refused at once, naming it."""
    for at, arg in enumerate(args):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            shown = os.fsencode(arg).decode("utf-8", "backslashreplace")
            after = f" (after {args[at - 1]})" if at and args[at - 1].startswith("-") else ""
            raise DistsetupError(
                f"the argument '{shown}'{after} is not UTF-8, and every file distsetup reads or writes is.",
                "give it in UTF-8 (rename the file or folder).",
            ) from None


def first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of an error's message (at most `limit` characters; where Python errors say what happened), or
    its type."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def last_line(error: BaseException) -> str:
    """The last line of an error's message (where C++ and DCP errors say what happened), or its type."""
    text = str(error).strip()
    return text.splitlines()[-1] if text else type(error).__name__
