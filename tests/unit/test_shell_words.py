"""The command a generated file's header says it was written with gives each value back when pasted into bash."""

import os
import subprocess

import pytest

from distsetup.scripts.shell_words import one_line_word


@pytest.mark.parametrize(
    "text",
    ["plain", "two words", "it's", "pip install x # c\necho hi", "tab\there", "back\\slash\n'quote'", "ünï\r\n", ""]
    + ["next\u0085line", "line\u2028separator"],  # line breaks to YAML
)
def test_a_word_is_one_line_that_bash_reads_back_as_the_text(text):
    """A multi-line --setup was written with \\n inside single quotes: pasted, its second line became part of the
    first's comment."""
    word = one_line_word(text)
    assert "\n" not in word and "\r" not in word
    utf8 = {**os.environ, "LC_ALL": "C.UTF-8"}  # where bash's \\u makes the character
    said = subprocess.run(["bash", "-c", f"printf '%s' {word}"], capture_output=True, check=True, env=utf8).stdout
    assert said.decode() == text  # bytes: text mode would read \r\n as \n
