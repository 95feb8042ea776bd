"""Every link between the repo's pages leads somewhere.

The README is a landing page that sends readers into docs/, and the pages send them to each
other and into the code: a page renamed, merged or a heading reworded must not leave a reader
at a dead link. Relative links must name a file or folder of the checkout; a ``#fragment``
must match a heading of the target page as GitHub makes its anchors.

Pages also name code without linking it: a file in backticks (``write/writer.py``) or a module
(``projector.bucket.reader``). A module moved or a file renamed must take its mentions along,
so each such name must still lead to something in the checkout.
"""

from __future__ import annotations

import re
import subprocess
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


NAMED_FILE = re.compile(r"`([A-Za-z0-9_./-]+\.(?:py|sh|mjs|json|ya?ml|conf|toml|md))(?::\d+)?`")
# ``projector.<wing>...``: the package whose modules move as the design does (``seqstate.<x>``
# is also how the NATS subjects and the loggers are named, so it is not checked here).
MODULE = re.compile(r"(?<![\w/.-])(projector(?:\.[A-Za-z_]\w*)+)")


def tracked() -> list[str]:
    done = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout.split()


def resolves(module: str) -> bool:
    """A module, or a name in one: its longest leading part that is a module exists; a name
    straight under the package is one it exports (``Name as Name``) or a dunder."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        base = ROOT.joinpath(*parts[:n])
        if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
            return True
    name = re.escape(parts[1])
    init = (ROOT / parts[0] / "__init__.py").read_text()
    return parts[1].startswith("__") or re.search(rf"\b{name} as {name}\b", init) is not None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_and_module_a_page_names_exists(page: Path) -> None:
    files = tracked()
    gone: list[str] = []
    for name in NAMED_FILE.findall(page.read_text()):
        if name.startswith((".venv", "~")):
            continue
        here = (ROOT / name).exists() or (page.parent / name).exists()
        if not here and not any(f.endswith("/" + name) or f == name for f in files):
            gone.append(name)
    gone += [m for m in MODULE.findall(page.read_text()) if not resolves(m)]
    assert not gone, f"{page.relative_to(ROOT)} names what is not in the checkout: {gone}"


def test_a_moved_module_is_caught() -> None:
    assert resolves("projector.bucket.reader.RegistryView")
    assert not resolves("projector.read.reader.RegistryView")
    assert not resolves("projector.Nowhere")
    assert resolves("projector.RegistryView")
