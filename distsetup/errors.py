"""The one error type users can cause, said in one line with the fix. It knows nothing of Click: the CLI
(distsetup/cli/main.py) and the trainer (distsetup/train.py) each turn it into their one line and exit status."""


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
