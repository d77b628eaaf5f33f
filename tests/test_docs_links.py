"""The README and docs/ pages: every relative link and #anchor resolves, and the README stays short."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6} (.+)", line)
        if m:
            slug = github_slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # links in code are not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_github_slug_matches_githubs_rules() -> None:
    assert github_slug("2c. Pretrain T5") == "2c-pretrain-t5"
    assert github_slug("lm-evaluation-harness and OpenAI-compatible completions") == \
        "lm-evaluation-harness-and-openai-compatible-completions"
    assert github_slug("Finetuning: MNLI, QQP, RACE") == "finetuning-mnli-qqp-race"
    assert github_slug("`--use-checkpoint-args` restores") == "--use-checkpoint-args-restores"


def test_docs_exist_and_are_linked_from_the_readme() -> None:
    assert len(PAGES) > 10
    readme_links = {t.split("#")[0] for t in links(REPO / "README.md")}
    unlinked = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in readme_links]
    assert not unlinked, f"docs pages not linked from README.md: {unlinked}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    found = links(page)
    broken = []
    for target in found:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_readme_is_short() -> None:
    size = len((REPO / "README.md").read_text(encoding="utf-8").encode("utf-8"))
    assert size < 15_000, f"README.md is {size} bytes: move detail into docs/"
    for line in (REPO / "README.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            assert len(line) <= 160, f"feature table rows stay one line: {line[:80]}..."
