"""User text in generated scripts: control characters refused in what goes into them (check_text), and a value as
one bash word on one line for the command a file's header says it was written with (pasted into bash, the line
gives each value back, a multi-line --setup included)."""

import shlex

from distsetup.errors import DistsetupError

ANSI_C_ESCAPES = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def is_control(character: str) -> bool:
    """A character that ends or breaks a line somewhere: C0 and C1 controls, DEL, and Unicode's line and paragraph
    separators (YAML reads U+0085, U+2028 and U+2029 as line breaks)."""
    code = ord(character)
    return code < 32 or 127 <= code < 160 or code in (0x2028, 0x2029)


def one_line_word(text: str) -> str:
    """`text` as one bash word on one line (a comment's): shlex's quoting, or bash's $'...' where it holds a
    newline or another control character, so that the line pasted into bash gives the text back."""
    if not any(is_control(c) for c in text):
        return shlex.quote(text)
    escaped = "".join(ANSI_C_ESCAPES.get(c) or (_escape(c) if is_control(c) else c) for c in text)
    return f"$'{escaped}'"


def _escape(character: str) -> str:
    code = ord(character)
    return f"\\x{code:02x}" if code < 128 else f"\\u{code:04x}"  # \u: the character, in a UTF-8 locale


# The inputs that name a file or folder, which may be named so by accident
PATH_INPUTS = ("--script", "--config", "--deepspeed_config", "--fsdp_config", "the working folder")


def check_text(name: str, value: str | None) -> None:
    """User text goes into scripts quoted; a control character (a newline) in a name or path is refused."""
    if value is not None and any(is_control(c) for c in value):
        rename = " (a file or folder named so: rename it)" if name in PATH_INPUTS else ""
        raise DistsetupError(
            f"{name} {value!r} contains a control character (newline, tab, ...).", f"give {name} without one{rename}."
        )
