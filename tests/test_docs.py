"""The README's Quick start is exactly two commands, and CI runs the second one verbatim."""

import re
from pathlib import Path

from slimact.bench.document import build

ROOT = Path(__file__).resolve().parents[1]


def _quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section, flags=re.S)


def test_quick_start_has_two_commands():
    cmds = _quick_start_commands()
    assert len(cmds) == 2 and all("\n" not in c for c in cmds)
    assert "torch==2.13.0" in cmds[0] and "slimact train" in cmds[0]
    assert "pytest" in cmds[1] and '-m "not slow"' in cmds[1], "slow tests stay out of CI"
    venv = "python -m venv .venv && . .venv/bin/activate && "
    for c in cmds:  # a fresh, empty environment: an undeclared dependency fails the command
        assert c.startswith(venv), c
        assert c.index("torch==2.13.0") < c.index(" -e "), "torch first: no CUDA wheels"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    m = re.search(r"TEST_COMMAND='(.+)'", ci)
    assert m and m.group(1) == _quick_start_commands()[1]


def test_architecture_and_benchmarks_exist():
    for name in ("ARCHITECTURE.md", "BENCHMARKS.md"):
        assert (ROOT / name).is_file(), name


def test_benchmarks_md_is_generated_from_the_results():
    """BENCHMARKS.md is ``slimact.bench.document.build`` of benchmarks/results: a hand edit
    there (lost at the next regeneration) or a summary missing from its sections fails here."""
    want = build(ROOT / "benchmarks" / "results")
    assert (ROOT / "BENCHMARKS.md").read_text() == want, (
        "BENCHMARKS.md differs from its sources: edit benchmarks/results/*.md (and "
        "slimact.bench.document.SECTIONS), then run python benchmarks/build_report.py"
    )


def test_src_names_no_issue_numbers():
    """Comments and docstrings in src/ point to BENCHMARKS.md or ARCHITECTURE.md, never to an
    issue: the numbers mean nothing to a reader of the code and go stale."""
    pattern = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in sorted((ROOT / "src").rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, "\n".join(hits)
