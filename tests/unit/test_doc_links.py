"""Every relative link of README.md and docs/*.md resolves: the file exists and, for `file.md#anchor`, one of
that file's headings makes the anchor, as GitHub makes them (lower case; punctuation but `-` and `_` dropped;
each space a `-`; a repeated heading gets `-1`, `-2`, ...). Links inside code (fenced blocks, `inline`) are
text, not links. Moving a section or renaming a heading breaks the links to it: this names each one. And every
test file the documents name (`tests/.../test_x.py`: the README's "What holds" table, the docs' lists of tests)
exists: a renamed or merged test leaves no promise pointing at nothing.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```.*?^\s*```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
TEST_FILE = re.compile(r"\btests/[\w/*]+\.py\b")


def anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path):
    seen: dict[str, int] = {}
    for line in FENCE.sub("", path.read_text()).splitlines():
        heading = re.match(r"#{1,6}\s+(.*)$", line)
        if heading:
            name = anchor(heading.group(1))
            seen[name] = seen.get(name, -1) + 1
            yield name if seen[name] == 0 else f"{name}-{seen[name]}"


def links(path: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", path.read_text()))
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def broken(path: Path, root: Path = ROOT) -> list[str]:
    out = []
    for target in links(path):
        file, _, fragment = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            out.append(f"{path.relative_to(root)}: {target} (no such file)")
        elif fragment and linked.suffix == ".md" and fragment not in set(anchors(linked)):
            out.append(f"{path.relative_to(root)}: {target} (no heading of {linked.relative_to(root)} makes it)")
    return out


def test_anchors_are_githubs():
    assert anchor("Parity: `python -m parallel.verify`") == "parity-python--m-parallelverify"
    assert anchor("Wan 2.2 A14B") == "wan-22-a14b"
    assert anchor("Ulysses, ring attention and both") == "ulysses-ring-attention-and-both"
    assert anchor("Loading: `model.init_from`") == "loading-modelinit_from"
    assert {"which-module-does-what", "rules", "adding-a-family"} <= set(anchors(ROOT / "docs" / "architecture.md"))


def test_a_moved_heading_is_named(tmp_path):
    doc = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# B\n\n## Tested\n\n## Tested\n\n```bash\n# not a heading\n```\n")
    doc.write_text("[x](b.md#tested-1) [y](b.md#not-a-heading) [z](c.md) `[w](c.md)` [u](https://e.org/#q)\n")
    found = [line.split(": ", 1)[1] for line in broken(doc, tmp_path)]
    assert found == ["b.md#not-a-heading (no heading of b.md makes it)", "c.md (no such file)"]


def test_every_link_of_the_readme_and_the_docs_resolves():
    assert len(DOCS) > 10 and sum(len(links(doc)) for doc in DOCS) > 100
    bad = [line for doc in DOCS for line in broken(doc)]
    assert not bad, "links that lead nowhere:\n" + "\n".join(bad)


def missing_tests(path: Path, root: Path = ROOT) -> list[str]:
    """The test files `path` names that match no file (a glob such as tests/distributed/test_ring_*.py: none)."""
    return [f"{path.relative_to(root)}: {name}" for name in sorted(set(TEST_FILE.findall(path.read_text())))
            if not any(root.glob(name))]


def test_every_test_file_the_documents_name_exists(tmp_path):
    named = sum(len(set(TEST_FILE.findall(doc.read_text()))) for doc in DOCS)
    assert named > 50
    bad = [line for doc in DOCS for line in missing_tests(doc)]
    assert not bad, "test files named that do not exist:\n" + "\n".join(bad)
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_a.py").write_text("")
    (tmp_path / "d.md").write_text("`tests/unit/test_a.py`, `tests/unit/test_b.py`, tests/unit/test_*.py, tests/cli/test_*.py")
    assert missing_tests(tmp_path / "d.md", tmp_path) == ["d.md: tests/cli/test_*.py", "d.md: tests/unit/test_b.py"]
