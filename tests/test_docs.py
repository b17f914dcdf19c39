"""The repository stands alone: its docs cite only what it ships.

No file cites a contract that is not in the repository (docs/model.md and docs/semantics.md
are the contract); every relative link and every path a page names resolves; install hints
work from a wheel and from a source checkout; the ``testing`` extra runs docs/testing.md's
examples."""

from __future__ import annotations

import configparser
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]

#: a contract kept outside the repository: its directory, or its name as a citation
#: (written in pieces, so that this file does not cite it either)
OUTSIDE = re.compile(r"\.\./" + "shared" + r"|\b" + "SP" + r"EC\b")


def _tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        files = [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):             # not a git checkout (an sdist)
        files = [p for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    return [p for p in files if p.suffix in {".md", ".py", ".cfg", ".toml", ".cu", ".cuh", ".sh", ".txt", ".json",
                                             ".yml", ".yaml", ""} and p.is_file()]


def test_nothing_cites_a_contract_outside_the_repository():
    hits = []
    for p in _tracked_text_files():
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not hits, "cites a contract the repository does not ship:\n" + "\n".join(hits)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces -."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_named_path_resolves(page):
    text = page.read_text()
    bad = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):                   # [text](target)
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):                  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"link {target!r}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"link {target!r}: no heading with anchor #{anchor} in {dest.name}")
    for m in re.finditer(r"(?<![\w/.])((?:docs|benchmarks|tests|scripts|mtpkern|kernels)/[\w./-]*\w\.(?:md|py|sh|cuh|cu|json))(?!\w)",
                         text):                                        # docs/x.md, mtpkern/y.py as plain text
        if not (ROOT / m.group(1)).exists():
            bad.append(f"names {m.group(1)!r}, which is not in the repository")
    assert not bad, f"{page.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_install_hints_give_the_source_checkout_form_too():
    """``pip install 'mtpkern[x]'`` looks mtpkern up on PyPI: from a source checkout it fails
    (or installs another copy). Every hint gives ``pip install -e '.[x]'`` beside it."""
    files = PAGES + sorted((ROOT / "mtpkern").rglob("*.py"))
    bad = []
    for p in files:
        text = p.read_text()
        for m in re.finditer(r"pip install '?mtpkern\[([\w,]+)\]'?", text):
            near = text[m.end():m.end() + 300]
            if f"-e '.[{m.group(1)}]'" not in near and f"-e \".[{m.group(1)}]\"" not in near:
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{p.relative_to(ROOT)}:{line}: {m.group(0)} without pip install -e '.[{m.group(1)}]'")
    assert not bad, "\n".join(bad)


def test_the_testing_extra_brings_pytest():
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "setup.cfg")
    testing = cfg["options.extras_require"]["testing"]
    assert re.search(r"^\s*pytest\b", testing, flags=re.M), testing
    assert re.search(r"^\s*hypothesis\b", testing, flags=re.M), testing
