"""The README and the docs against the repository: CI runs exactly the test command the docs give, and the README's
links lead somewhere."""

import re
import shlex

from documents import DEVELOPMENT, GETTING_STARTED, README, commands, runnable_blocks, section
from repo import REPO


def test_ci_runs_the_test_command_the_docs_give():
    """`.ci/run` ends with exactly the command the README's and the development page's Development sections
    give, so what a contributor runs is what CI runs."""
    last = shlex.split((REPO / ".ci" / "run").read_text().strip().splitlines()[-1])
    assert last in commands(runnable_blocks(section(README.read_text(), "Development")))
    assert last in commands(runnable_blocks(DEVELOPMENT.read_text()))


def test_the_readme_quick_start_runs_inside_the_getting_started_page():
    """Every command of the README's quick start is one of the getting-started page's, in the same order, so the
    run of that page (tests/processes/test_docs_commands.py) runs the README's too."""
    quick_start = commands(runnable_blocks(section(README.read_text(), "Quick start")))
    getting_started = iter(commands(runnable_blocks(GETTING_STARTED.read_text())))
    assert quick_start
    assert all(command in getting_started for command in quick_start), quick_start  # in order: the iterator goes on


def test_readme_links_lead_somewhere():
    """The README is read on its own (mkdocs never builds it): each relative link names a file of the repository,
    each #anchor a heading of the README."""
    text = README.read_text()
    anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        if path:
            assert (REPO / path).exists(), link
        else:
            assert anchor in anchors, (link, sorted(anchors))


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
