"""BENCHMARKS.md's parts: a summary's hand-written reading survives its script's rerun."""

from slimact.bench.document import READING_MARK, demote, write_summary


def test_write_summary_keeps_the_reading_below_the_mark(tmp_path):
    md = tmp_path / "study.md"
    first = write_summary(md, "# Study\n\n| a |\n| 1 |\n")
    assert first == f"# Study\n\n| a |\n| 1 |\n\n{READING_MARK}\n" and md.read_text() == first
    md.write_text(first + "Reading: a is 1, by hand.\n")
    second = write_summary(md, "# Study\n\n| a |\n| 2 |")  # the rerun: new table, same reading
    assert second == f"# Study\n\n| a |\n| 2 |\n\n{READING_MARK}\nReading: a is 1, by hand.\n"
    assert md.read_text() == second


def test_demote_drops_the_title_pushes_headings_down_and_rebases_links():
    md = "# Title\n\n## Part\n![plot](p.png) [web](https://x.org)\n```\n# code\n```\n"
    assert demote(md) == (
        "### Part\n![plot](benchmarks/results/p.png) [web](https://x.org)\n```\n# code\n```"
    )


def test_a_later_study_keeps_its_title_under_the_section():
    md = "# Study two\n\n## Part\ntext\n```\n# code\n```\n"
    assert demote(md, keep_title=True) == "### Study two\n\n#### Part\ntext\n```\n# code\n```"
