"""The docs check's own reading of Markdown: what it finds, it finds as GitHub and mkdocs do."""

from __future__ import annotations

from pathlib import Path

from ._markdown import anchors, blocks, github_slug, links, mkdocs_slug


def test_slugs_follow_github_and_mkdocs() -> None:
    assert github_slug("LockClient.from_url") == mkdocs_slug("LockClient.from_url") == "lockclientfrom_url"
    assert github_slug("The store fails: BackendError") == "the-store-fails-backenderror"
    assert github_slug("a - b") == "a---b"
    assert mkdocs_slug("a - b") == "a-b"
    assert github_slug("Überblick") == "überblick"
    assert mkdocs_slug("Überblick") == "uberblick"


def test_anchors_links_and_markers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## `configure()`: the defaults\n\n## Twice\n\n## Twice\n\n"
        "See [the defaults](#configure-the-defaults) and\n[a page](other.md#x).\n\n"
        "<!-- not-runnable: needs a cluster -->\n```python\nimport x\n```\n\n"
        "```python\n# ## not a heading, [not](a-link.md)\n```\n\n"
        "- item\n\n  ```text\n  indented\n  ```\n",
        encoding="utf-8",
    )
    github, mkdocs = anchors(page)
    assert {"title", "configure-the-defaults", "twice", "twice-1"} == github
    assert {"title", "configure-the-defaults", "twice", "twice_1"} == mkdocs
    assert [(link.line, link.target) for link in links(page)] == [(9, "#configure-the-defaults"), (10, "other.md#x")]
    found = blocks(page)
    assert [(block.line, block.lang, block.not_runnable) for block in found] == [
        (13, "python", "needs a cluster"),
        (17, "python", None),
        (23, "text", None),
    ]
    assert found[2].code == "indented\n"
