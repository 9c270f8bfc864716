"""The docs a newcomer relies on are in the repo and say what the code says they say:

- every `docs/NAME.md` the code, the tests, the benches and the README cite is in the
  repo, and so is the section it names (a number such as `docs/drafts.md 4.4` or a
  quoted heading such as `docs/performance.md, "The CPU backend here"`); every Markdown
  link in README.md and docs/ reaches a file and, with `#anchor`, a heading in it;
- nothing cites a file beside the checkout instead of in it.

(The import direction is tests/test_layers.py's; bench's imports, test_bench_scripts.py's.)
"""

from __future__ import annotations

import re
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
SKIP_DIRS = {"clients", "data", "node_modules", "__pycache__", "results"}

CITE = re.compile(r"docs/([a-z0-9-]+\.md)")
# what may follow a citation to name its section: `4.4`, `2a`, `section 3`, `sections 1-3`, `, "Heading`
NUMBERED = re.compile(r"\A,? (?:sections? )?(\d+[a-z]?(?:\.\d+)?)\b")
QUOTED = re.compile(r'\A,? "([^"\n]+)')
LINK = re.compile(r"\]\(([^)\s]+)\)")


def sources() -> list[Path]:
    """The files that may cite docs: Python under monolith/, bench/, tests/, and README.md."""
    found = [REPO / "README.md"]
    for root in ("monolith", "bench", "tests"):
        for path in (REPO / root).rglob("*.py"):
            if not SKIP_DIRS & set(path.relative_to(REPO).parts):
                found.append(path)
    return found


def headings(doc: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in doc.read_text().splitlines() if line.startswith("#")]


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def citations() -> list[tuple[str, str, str]]:
    """(where, doc name, the text after the citation on its line) of every citation."""
    found = []
    for path in sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in CITE.finditer(line):
                found.append((f"{path.relative_to(REPO)}:{number}", match.group(1), line[match.end():]))
    return found


def test_every_cited_doc_and_section_is_in_the_repo():
    problems = []
    for where, name, rest in citations():
        doc = DOCS / name
        if not doc.is_file():
            problems.append(f"{where}: docs/{name} does not exist")
            continue
        titles = headings(doc)
        numbered, quoted = NUMBERED.match(rest), QUOTED.match(rest)
        if numbered and not any(re.match(rf"{re.escape(numbered.group(1))}\b", t) for t in titles):
            problems.append(f"{where}: docs/{name} has no section {numbered.group(1)}")
        if quoted and not any(t.startswith(quoted.group(1).rstrip()) for t in titles):
            problems.append(f"{where}: docs/{name} has no heading {quoted.group(1)!r}")
    assert not problems, "\n".join(problems)


def test_markdown_links_reach_their_files_and_headings():
    problems = []
    for page in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            doc = (page.parent / file).resolve() if file else page
            if not doc.exists():
                problems.append(f"{page.relative_to(REPO)}: link {target} reaches no file")
            elif anchor and anchor not in {slug(t) for t in headings(doc)}:
                problems.append(f"{page.relative_to(REPO)}: link {target}: {doc.name} has no such heading")
            elif not doc.is_relative_to(REPO):
                problems.append(f"{page.relative_to(REPO)}: link {target} leaves the repo")
    assert not problems, "\n".join(problems)


BESIDE = "/".join(("..", "shared"))  # the folder beside a developer's checkout (spelled apart: not a citation)


def test_nothing_cites_a_file_beside_the_checkout():
    pages = [*sources(), *DOCS.glob("*.md"), REPO / "CHANGELOG.md", REPO / "pyproject.toml"]
    outside = [f"{p.relative_to(REPO)}:{n}" for p in pages for n, line in enumerate(p.read_text().splitlines(), 1)
               if BESIDE in line]
    assert not outside, outside


def commands_after(mark: str) -> str:
    """The line after `<!-- mark -->` and its code fence in README.md (.ci/run runs the test command's)."""
    lines = (REPO / "README.md").read_text().splitlines()
    at = lines.index(f"<!-- {mark} -->")
    assert lines[at + 1] == "```", f"README.md: <!-- {mark} --> is not followed by a code fence"
    return lines[at + 2]


def test_readme_set_up_commands_make_their_virtual_environment():
    """Debian's and Homebrew's Python refuse `pip install` outside a virtual environment
    (externally-managed-environment): the set-up lines make and enter one first."""
    for mark in ("main-command", "test-command"):
        line = commands_after(mark)
        venv, pip = line.find("python3 -m venv .venv && . .venv/bin/activate && "), line.find("pip install")
        assert 0 <= venv < pip, f"README.md {mark}: {line!r} installs outside a virtual environment"
