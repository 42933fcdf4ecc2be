"""The compiled-template cache: used when it can be, never in the way when it cannot."""

import jinja2
import pytest

from distsetup.scripts import templating


@pytest.fixture
def template(monkeypatch, tmp_path):
    """A template folder of one template, t.j2; returns a function that rewrites it."""
    folder = tmp_path / "templates"
    folder.mkdir()
    monkeypatch.setattr(templating, "templates_dir", lambda: folder)
    return lambda text: (folder / "t.j2").write_text(text)


def render_with(monkeypatch, cache, **context) -> str:
    monkeypatch.setattr(templating, "compiled_template_cache", lambda: cache)
    return templating.render("t.j2", **context)


def test_second_run_loads_the_compiled_template(monkeypatch, tmp_path, template):
    template("python {{ script | shquote }}\n")
    cache = templating.CompiledTemplateCache(str(tmp_path))
    first = render_with(monkeypatch, cache, script="a b.py")
    assert first == "python 'a b.py'\n" and list(tmp_path.glob("__distsetup_*"))
    monkeypatch.setattr(jinja2.Environment, "compile", lambda *a, **k: pytest.fail("compiled again"))
    assert render_with(monkeypatch, cache, script="a b.py") == first


def test_an_edited_template_is_compiled_afresh(monkeypatch, tmp_path, template):
    cache = templating.CompiledTemplateCache(str(tmp_path))
    template("one")
    assert render_with(monkeypatch, cache) == "one"
    template("two")
    assert render_with(monkeypatch, cache) == "two"


def test_a_cache_that_cannot_be_written_is_skipped(monkeypatch, tmp_path, template):
    template("{{ x }}")
    (tmp_path / "a_file").write_text("")
    unwritable = templating.CompiledTemplateCache(str(tmp_path / "a_file" / "cache"))
    assert render_with(monkeypatch, unwritable, x=1) == "1"
    assert render_with(monkeypatch, None, x=2) == "2"


def test_a_damaged_cache_file_is_compiled_afresh(monkeypatch, tmp_path, template):
    template("{{ x }}")
    cache = templating.CompiledTemplateCache(str(tmp_path))
    assert render_with(monkeypatch, cache, x=1) == "1"
    header, stored = len(jinja2.bccache.bc_magic), list(tmp_path.glob("*.cache"))
    assert stored
    for path in stored:
        path.write_bytes(path.read_bytes()[: header + 3])  # the header, then a broken-off checksum
    assert render_with(monkeypatch, cache, x=2) == "2"
