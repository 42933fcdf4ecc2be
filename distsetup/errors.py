"""The one error type users can cause: Click prints its message and exits 1."""

import click


class DistsetupError(click.ClickException):
    """A problem with the user's input, said in one line with the fix."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(f"{message} HINT: {hint}" if hint else message)
