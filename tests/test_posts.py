"""The posts quote the code they explain, and the quotes are the code: every ```python block in blogs/ opens with
a comment naming the file it is taken from, and its lines are that file's lines, in order (a line `...` skips
any number of them; indentation is free, so a quote can start inside a function). A change to the code that a
post quotes fails here until the post follows."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT

POSTS = sorted((ROOT / "blogs").glob("*.md"))
QUOTE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def quotes() -> list[tuple[str, int, str]]:
    """(post, line number, block) for every python block of every post."""
    found = []
    for post in POSTS:
        text = post.read_text()
        for m in QUOTE.finditer(text):
            found.append((post.name, text[: m.start()].count("\n") + 1, m.group(1)))
    return found


def appears_in_order(block: list[str], source: list[str]) -> bool:
    """The block's runs of lines (split at `...`) appear in `source` as runs, one after another."""
    pos = 0
    for run in "\n".join(block).split("\n...\n"):
        lines = run.split("\n")
        at = next((i for i in range(pos, len(source) - len(lines) + 1) if source[i : i + len(lines)] == lines), None)
        if at is None:
            return False
        pos = at + len(lines)
    return True


def test_the_posts_quote_code():
    names = {post for post, _, _ in quotes()}
    assert {"ddp.md", "fsdp.md", "pp.md", "tp-sp.md"} <= names, names


@pytest.mark.parametrize("post, line, block", quotes(), ids=lambda x: str(x)[:40])
def test_a_quote_names_its_file_and_is_its_code(post, line, block):
    first, *body = block.rstrip("\n").split("\n")
    named = re.fullmatch(r"# ((?:experiments|ftkit)/[\w./-]+\.py)(?:[ ,].*)?", first.strip())
    assert named, f"blogs/{post}:{line}: a quote opens with `# <file>` naming where it is from, got {first!r}"
    path = ROOT / named.group(1)
    assert path.exists(), f"blogs/{post}:{line}: {named.group(1)} does not exist"
    source = [s.strip() for s in path.read_text().splitlines()]
    quoted = [s.strip() for s in body]
    assert quoted and appears_in_order(quoted, source), (
        f"blogs/{post}:{line}: this quote is no longer {named.group(1)}'s code:\n" + "\n".join(body)
    )


# The series in reading order: the framework post first, then one technique after another.
SERIES = ["what-fills-gpu-memory.md", "ddp.md", "fsdp.md", "tp-sp.md", "pp.md", "fsdp-tp.md", "cp.md"]
FIGURE = re.compile(r"!\[[^\]]+\]\(\.\./assets/([\w.-]+\.png)\)")


def test_the_series_is_every_post():
    assert sorted(SERIES) == [p.name for p in POSTS]


@pytest.mark.parametrize("post", SERIES)
def test_a_post_is_at_most_3500_words(post):
    words = len((ROOT / "blogs" / post).read_text().split())  # as `wc -w` counts them
    assert words <= 3500, f"blogs/{post}: {words} words"


@pytest.mark.parametrize("post", SERIES)
def test_a_post_shows_a_figure_that_an_assets_script_draws(post):
    figures = FIGURE.findall((ROOT / "blogs" / post).read_text())
    assert figures, f"blogs/{post} shows no figure"
    scripts = {p.name: p.read_text() for p in (ROOT / "assets").glob("*.py")}
    for png in figures:
        assert (ROOT / "assets" / png).is_file(), f"blogs/{post}: assets/{png} is missing"
        assert any(png in text for text in scripts.values()), f"no assets/*.py writes {png}"


@pytest.mark.parametrize("i", range(len(SERIES)), ids=SERIES)
def test_a_post_links_the_previous_and_the_next(i):
    text = (ROOT / "blogs" / SERIES[i]).read_text()
    neighbours = SERIES[max(0, i - 1) : i] + SERIES[i + 1 : i + 2]
    for other in neighbours:
        assert f"]({other})" in text or f"]({other}#" in text, f"blogs/{SERIES[i]} does not link {other}"


def test_the_framework_post_and_the_readme_list_the_series_in_order():
    for doc, prefix in ((ROOT / "blogs" / SERIES[0], ""), (ROOT / "README.md", "blogs/")):
        text = doc.read_text()
        at = [text.find(f"]({prefix}{post}") for post in SERIES[1:]]
        assert all(a >= 0 for a in at) and at == sorted(at), f"{doc.name}: the posts in reading order {at}"
