"""A value as one bash word on one line, for the command a generated file's header says it was written with: pasted
into bash, the line gives each value back, a multi-line --setup included."""

import shlex

ANSI_C_ESCAPES = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def one_line_word(text: str) -> str:
    """`text` as one bash word on one line (a comment's): shlex's quoting, or bash's $'...' where it holds a
    newline or another control character, so that the line pasted into bash gives the text back."""
    if not any(ord(c) < 32 or ord(c) == 127 for c in text):
        return shlex.quote(text)
    escaped = "".join(
        ANSI_C_ESCAPES.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 32 or ord(c) == 127 else c) for c in text
    )
    return f"$'{escaped}'"
