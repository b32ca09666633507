"""Keep the tree's documentation true: dead links, dead anchors, stale citations, work logs.

    python scripts/check_docs.py [ROOT]

Fails (exit 1, one ``path:line: problem`` per finding) on
* a relative link in any Markdown file whose target does not exist, or whose ``#anchor``
  is not a heading of the target Markdown file (GitHub's slug rules);
* a ``docs/algorithm.md#anchor`` cited anywhere (code, docs) that docs/algorithm.md lacks;
* a repository path named anywhere (``docs/...``, ``scripts/...``, ``release/...``,
  ``packages/...`` with a file suffix, or a ``docs/results/`` folder) that does not exist;
* a citation of the design inputs outside the repository (``ALGORITHM.md``,
  ``ARCHITECTURE.md``, ``STYLE.md``, ``ANCHOR-FIGURES.md``) or of a ``§`` section number;
* work-log wording (numbered sessions, calls and runs, "the owner") in Markdown and sources.
Standard library only; it reads the files git tracks (or, without git, walks the tree).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

TEXT = {".py", ".md", ".sh", ".toml", ".txt", ".yml", ".yaml", ".cfg", ".ini"}
GIT_FILES = ["git", "ls-files", "-co", "--exclude-standard"]
SKIP_DIRS = {".git", ".nox", "dist", "out", "__pycache__", "node_modules"}
ALGORITHM = "docs/algorithm.md"
#: This checker and its tests spell out the patterns they look for.
EXEMPT = {"scripts/check_docs.py", "scripts/tests/test_check_docs.py"}
ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|"
    "twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|"
    "nineteenth|twentieth|\\d+(?:st|nd|rd|th)"
)
WORK_LOG = [
    re.compile(r"\b(?:sessions?|calls?)[ _-]?#?\d+\b", re.I),
    re.compile(r"\bruns?[ _-]?#?\d+(?:\s*[-–]\s*\d+)?(?=\s*(?:$|[.,;:)'’]|\())", re.I),
    re.compile(rf"\b(?:{ORDINALS}) (?:session|call)\b", re.I),
    re.compile(r"\b(?:fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+th) run\b", re.I),
    re.compile(
        r"\b(?:for|by|to|asks?|asked|waits? for) the owner\b(?!\s+(?:ranks?|pipeline))", re.I
    ),
    re.compile(r"\b(?:next|previous|earlier) (?:session|GPU run)\b", re.I),
]
WORK_LOG_HINT = re.compile(r"session|call|run|owner|previous|next|earlier")
CITATION = re.compile(r"(?:ALGORITHM|ARCHITECTURE|STYLE|ANCHOR-FIGURES)\.md|§")
ANCHOR_CITE = re.compile(r"docs/algorithm\.md#([A-Za-z0-9_-]+)")
#: A repository path named in prose or code: it must exist (stale pointers into deleted files or
#: results folders of past runs).
PATH_MENTION = re.compile(
    r"(?<![\w./<-])((?:docs|scripts|release|packages)/[\w.-]+(?:/[\w.-]+)*"
    r"\.(?:md|py|sh|json|png|txt|log|toml))\b|(?<![\w./-])(docs/results/[\w.-]+)"
)
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ID = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def tracked_files(root: Path) -> list[Path]:
    try:
        listed = subprocess.check_output(GIT_FILES, cwd=root, text=True, stderr=subprocess.DEVNULL)
        files = [root / line for line in listed.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):
        files = [p for p in root.rglob("*") if not SKIP_DIRS & set(p.relative_to(root).parts)]
    return sorted(p for p in files if p.suffix in TEXT and p.is_file())


def slug(text: str) -> str:
    """GitHub's heading anchor: links reduced to their text, lower case, punctuation dropped
    (letters, digits, ``_``, ``-`` and spaces kept), spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a Markdown file defines (headings outside code fences, HTML ids)."""
    seen: dict[str, int] = {}
    found = set(HTML_ID.findall(text))
    for line in prose_lines(text):
        m = HEADING.match(line[1])
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of a Markdown file outside fenced code blocks."""
    out, fence = [], ""
    for n, line in enumerate(text.splitlines(), start=1):
        m = re.match(r"^\s{0,3}(`{3,}|~{3,})", line)
        if m and (not fence or m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence)):
            fence = "" if fence else m.group(1)
            continue
        if not fence:
            out.append((n, line))
    return out


def check(root: Path, only: list[str] | None = None) -> list[str]:
    """Every problem in the tree at ``root`` (or in the files ``only`` names, relative)."""
    root = root.resolve()
    cache: dict[Path, set[str]] = {}

    def anchors_of(path: Path) -> set[str]:
        if path not in cache:
            cache[path] = anchors(path.read_text(encoding="utf-8", errors="replace"))
        return cache[path]

    problems: list[str] = []
    for path in tracked_files(root) if only is None else [root / rel for rel in only]:
        rel = path.relative_to(root).as_posix()
        if rel.startswith("docs/results/") and path.suffix != ".md":
            continue  # data files: logs and JSON written by the commands, not prose
        text = path.read_text(encoding="utf-8", errors="replace")
        if rel not in EXEMPT:
            for n, line in enumerate(text.splitlines(), start=1):
                found = _line_problems(root, line, path.suffix == ".md", anchors_of)
                problems += [f"{rel}:{n}: {p}" for p in found]
        if path.suffix == ".md":
            for n, line in prose_lines(text):
                line = re.sub(r"`[^`]*`", "", line)
                targets = LINK.findall(line) + [m.group(1) for m in [REF_DEF.match(line)] if m]
                for target in targets:
                    problem = _check_link(root, path, target, anchors_of)
                    if problem:
                        problems.append(f"{rel}:{n}: {problem}")
    return problems


def _line_problems(root: Path, line: str, is_md: bool, anchors_of) -> list[str]:  # type: ignore[no-untyped-def]
    out = []
    if CITATION.search(line):
        out.append(
            f"cites a design document outside the repository or a § section; cite "
            f"{ALGORITHM}#<anchor> instead"
        )
    prose = re.sub(r"\]\([^)]*\)", "]", line) if is_md else line  # links: checked as links
    for m in PATH_MENTION.finditer(prose) if "/" in line else []:
        if not (root / (m.group(1) or m.group(2))).exists():
            out.append(f"names {m.group(1) or m.group(2)}, which does not exist")
    for anchor in ANCHOR_CITE.findall(line) if "#" in line else []:
        if not (root / ALGORITHM).is_file() or anchor not in anchors_of(root / ALGORITHM):
            out.append(f"{ALGORITHM}#{anchor} is not a section of {ALGORITHM}")
    for pattern in WORK_LOG if WORK_LOG_HINT.search(line.lower()) else []:
        m = pattern.search(line)
        if m:
            out.append(f"work-log wording {m.group(0)!r}: say what is true now (git keeps history)")
            break
    return out


def _check_link(root: Path, source: Path, target: str, anchors_of) -> str | None:  # type: ignore[no-untyped-def]
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
        return None
    ref, _, anchor = target.partition("#")
    if not ref:
        dest = source
    elif ref.startswith("/"):
        dest = root / ref.lstrip("/")
    else:
        dest = (source.parent / ref).resolve()
    if not dest.exists():
        return f"dead link {target!r} (no such file)"
    if anchor and dest.suffix == ".md" and anchor not in anchors_of(dest):
        return f"dead link {target!r} (no heading #{anchor} in {dest.name})"
    return None


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    problems = check(root)
    for p in problems:
        print(p)
    print(f"check_docs: {len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
