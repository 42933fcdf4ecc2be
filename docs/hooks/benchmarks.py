"""MkDocs hook: each benchmark's latest table, read from benchmarks/RESULTS.md at build time, so the page
never holds a hand-copied figure.

The benchmark scripts append a section to RESULTS.md per run (`## Title`, then the date, machine and command,
the table and its notes; benchmarks/common.py's `record`). A page holds `<!-- results: Title -->` where the
newest section of that title goes, its heading left out; a title that RESULTS.md lacks fails the build.
"""

import re
from pathlib import Path

from mkdocs.exceptions import PluginError

MARKER = re.compile(r"<!-- results: (.+?) -->")


def on_page_markdown(markdown: str, page, config, files) -> str:
    if not MARKER.search(markdown):
        return markdown
    results = Path(config.config_file_path).parent / "benchmarks" / "RESULTS.md"
    newest = latest_sections(results.read_text())

    def body(match: re.Match) -> str:
        title = match.group(1)
        if title not in newest:
            raise PluginError(f"{page.file.src_uri}: no section '## {title}' in {results}; titles: {sorted(newest)}")
        return newest[title]

    return MARKER.sub(body, markdown)


def latest_sections(text: str) -> dict[str, str]:
    """Title -> the body of the last `## Title` section (later sections of a title replace earlier ones)."""
    sections: dict[str, str] = {}
    for chunk in re.split(r"^## ", text, flags=re.M)[1:]:
        title, _, body = chunk.partition("\n")
        sections[title.strip()] = body.strip()
    return sections
