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
