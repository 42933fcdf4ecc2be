"""The documentation's runnable parts: the README's sections and the docs pages' `bash` blocks, as the tests of the
docs read them (tests/unit/test_docs_agree.py, tests/processes/test_docs_commands.py)."""

import re
import shlex

from repo import REPO

README = REPO / "README.md"
GETTING_STARTED = REPO / "docs" / "getting-started.md"
DEVELOPMENT = REPO / "docs" / "development.md"
FENCE = re.compile(r"^```bash([^\n]*)\n(.*?)^```$", re.M | re.S)
MAX_STEPS = 12  # DISTSETUP_MAX_STEPS: the trainer stops after this many optimizer steps


def section(markdown: str, title: str) -> str:
    """The text of the `## title` section, up to the next heading of level 1 or 2."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^##? |\Z)", markdown, re.M | re.S)
    assert match, f"no '## {title}' section"
    return match.group(1)


def runnable_blocks(markdown: str) -> list[str]:
    """Every ```bash block, in order, but those whose info string holds .no-run."""
    return [body for info, body in FENCE.findall(markdown) if ".no-run" not in info]


def commands(blocks: list[str]) -> list[list[str]]:
    """Each command of the blocks as its words: continued lines joined, comments and blank lines left out."""
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [words for line in lines if (words := shlex.split(line, comments=True))]
