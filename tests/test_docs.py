"""The README's Quick start is exactly two commands, and CI runs the second one verbatim."""

import io
import re
import tokenize
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


def test_src_quotes_no_measured_timings():
    """Comments and docstrings in src/ quote no measured timings or speed ratios (``11 ms``,
    ``3x slower``, ``1.006x``): they go stale; the figures live in BENCHMARKS.md. Read from the
    tokens, so a format string or a help text that prints a measured value is not a hit."""
    timing = re.compile(
        r"\b\d+(\.\d+)? ?(ms|us|µs)\b|\b\d+(\.\d+)?x (faster|slower)\b|\b\d\.\d{2,}x\b"
    )
    hits = []
    for p in sorted((ROOT / "src").rglob("*.py")):
        for tok in tokenize.generate_tokens(io.StringIO(p.read_text()).readline):
            is_doc = tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU").startswith(
                ('"""', "'''")
            )
            if (tok.type == tokenize.COMMENT or is_doc) and timing.search(tok.string):
                hits.append(f"{p.relative_to(ROOT)}:{tok.start[0]}: {timing.search(tok.string)[0]}")
    assert not hits, "\n".join(hits)
