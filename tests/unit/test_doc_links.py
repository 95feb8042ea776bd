"""Every link between the repo's pages leads somewhere.

The README is a landing page that sends readers into docs/, and the pages send them to each
other and into the code: a page renamed, merged or a heading reworded must not leave a reader
at a dead link. Relative links must name a file or folder of the checkout; a ``#fragment``
must match a heading of the target page as GitHub makes its anchors.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")]
    + [p for p in (ROOT / "tests").rglob("README.md")]
    + [ROOT / "data" / "README.md"]
)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        if fenced:
            continue
        found.update(re.findall(r'<a id="([^"]+)"', line))
        if not line.startswith("#"):
            continue
        base = anchor(line.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    out: list[str] = []
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        if not fenced:
            out.extend(LINK.findall(line))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_leads_somewhere(page: Path) -> None:
    dead: list[str] = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            dead.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            dead.append(f"{target}: no such heading in {dest.relative_to(ROOT)}")
    assert not dead, f"{page.relative_to(ROOT)}: " + "; ".join(dead)


def test_the_anchor_rule() -> None:
    assert anchor(" Try it: `make dynamo-demo`") == "try-it-make-dynamo-demo"
    fidelity = "9-fidelity-what-seqstate-cannot-know"
    assert anchor(" 9. Fidelity: what seqstate cannot know") == fidelity
    assert anchor(" One size rule, every door") == "one-size-rule-every-door"
