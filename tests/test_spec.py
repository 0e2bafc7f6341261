"""``slimact.spec``: the one grammar of a strategy spec, and the only module that parses one.

``test_no_module_but_spec_parses_a_spec`` reads every module under ``src/slimact`` with ``ast``
and fails on what parses a spec outside ``spec.py``:

* a call of ``split``/``rsplit``/``partition``/``rpartition`` whose separator is the literal
  ``"+"`` or ``"@"`` (splitting a spec into parts, or a part into its name and settings), or
  ``spec.SEP``/``spec.AT`` (the grammar's own separators, used to split elsewhere);
* any reference to ``Budget.parse`` (a budget is text parsed by ``spec.parse_budget``), except in
  ``budget.py``, the ``Budget`` type's own module, whose ``--budget`` flag reads through it.

It does not flag other grammars that happen to use ``+``: an action word (``offload+codec:...``)
and a wrapped codec label (``offload+int8``) split on ``actions.THEN``; nor ``"/"`` inside a
codec label, nor a ``,`` or ``/`` split of text that is not a spec.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from slimact import spec
from slimact.budget import Budget
from slimact.registry import compiled_spec, resolve, with_budget

SRC = Path(__file__).resolve().parents[1] / "src" / "slimact"
SPLITS = {"split", "rsplit", "partition", "rpartition"}
BUDGET_OWNER = "budget.py"  # defines Budget.parse; its --budget flag's argparse type calls it


def spec_parsing(source: str, filename: str = "<module>") -> list[str]:
    """Where ``source`` parses a spec (module docstring): ``"<line>: <what>"`` for each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in SPLITS and node.args:
                sep = node.args[0]
                literal = isinstance(sep, ast.Constant) and sep.value in ("+", "@")
                named = (isinstance(sep, ast.Name) and sep.id in ("SEP", "AT")) or (
                    isinstance(sep, ast.Attribute) and sep.attr in ("SEP", "AT")
                )
                if literal or named:
                    found.append(f"{node.lineno}: .{node.func.attr}({ast.unparse(sep)})")
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "parse"
            and isinstance(node.value, ast.Name)
            and node.value.id == "Budget"
            and filename != BUDGET_OWNER
        ):
            found.append(f"{node.lineno}: Budget.parse")
    return found


def test_no_module_but_spec_parses_a_spec():
    bad = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "spec.py":
            continue
        if hits := spec_parsing(path.read_text(), rel):
            bad[rel] = hits
    assert not bad, f"parse specs through slimact.spec, not by hand: {bad}"


@pytest.mark.parametrize(
    "source",
    [
        "name, _, arg = part.partition('@')",
        "parts = strategy.split('+')",
        "base = label.split('@', 1)[0]",
        "a, b = text.rpartition(SEP)",
        "x = s.split(spec.AT)",
        "b = Budget.parse(text)",
        "f = Budget.parse",
    ],
)
def test_the_scan_finds_spec_parsing(source):
    assert spec_parsing(source)


@pytest.mark.parametrize(
    "source",
    [
        "a = label.partition('/')",
        "xs = text.split(',')",
        "o, _, i = label.partition(THEN)",
        "t = f'{name}@{arg}'",
        "parts = spec.parse(text)",
    ],
)
def test_the_scan_leaves_other_text_alone(source):
    assert not spec_parsing(source)


# -- the grammar ----------------------------------------------------------------------------------

CANONICAL = [
    "none",
    "invact+int4",
    "auto@25%",
    "auto@6GiB,codecs=int4/int8,repeats=1",
    "int4@sr",
    "int8@sr,group_size=32",
    "compiled-int8@0",
    "compiled-int8@0.25,sr",
    "chunked-ce@256,precompute",
    "prac@t1=20,t2=1,svd=randomized",
    "invact@bf16=exact-near-branch,ops=none+compiled-none",
    "compiled-auto@30%,codecs=none/int8,budgets=1/0,rounds=2",
]


@pytest.mark.parametrize("text", CANONICAL)
def test_round_trip(text):
    parts = spec.parse(text)
    assert spec.join(parts) == text
    assert spec.parse(spec.join(parts)) == parts


@pytest.mark.parametrize(
    "written, canonical",
    [
        ("int4@rounding=stochastic", "int4@sr"),  # stochastic rounding: one spelling, sr
        ("compiled-int8@0.25,rounding=stochastic", "compiled-int8@0.25,sr"),
        ("compiled-int8@region=0.25", "compiled-int8@0.25"),  # region budget: bare
        ("chunked-ce@mode=precompute,chunk_size=128", "chunked-ce@precompute,128"),
        (" invact + int4 ", "invact+int4"),
        ("chunked-ce@mode=fast", "chunked-ce@mode=fast"),  # not a bare mode: kept keyed
        ("auto@ 25% , repeats = 1", "auto@25%,repeats=1"),
    ],
)
def test_one_spelling_printed_back(written, canonical):
    assert spec.join(spec.parse(written)) == canonical
    assert spec.parse(written) == spec.parse(canonical)


def test_parts_carry_typed_settings():
    (auto,) = spec.parse("auto@25%,codecs=int4/int8")
    assert auto == spec.Part("auto", (("codecs", "int4/int8"),), Budget.parse("25%"))
    assert auto.budget.share == 0.25 and auto.get("codecs") == "int4/int8"
    (ce,) = spec.parse("chunked-ce@256,precompute")
    assert ce.settings == (("chunk_size", "256"), ("mode", "precompute"))
    (c,) = spec.parse("compiled-int4@0.5,sr")
    assert c.settings == (("region", "0.5"), ("rounding", "stochastic"))
    (other,) = spec.parse("int4@5")  # an item no setting takes: kept, unkeyed, for the error
    assert other.settings == (("", "5"),)
    assert spec.compiles_blocks("invact+compiled-int8@0") and not spec.compiles_blocks("int8")
    assert spec.names("invact+auto@25%") == ["invact", "auto"]


def test_settings_read_by_fields():
    fields = {"n": int, "on": spec.flag, "xs": spec.listed(float), "cap": spec.optional(float)}
    (p,) = spec.parse("x@n=3,on=yes,xs=1/0.5,cap=none")
    assert spec.settings(p, fields) == {"n": 3, "on": True, "xs": (1.0, 0.5), "cap": None}
    (p,) = spec.parse("x@10%")
    assert spec.settings(p, {}, takes_budget=True) == {"budget": Budget.parse("10%")}


@pytest.mark.parametrize(
    "text, match",
    [
        ("int4+", r"'int4\+' has an empty part: join names with single '\+'"),
        ("@sr", r"part without a name: '@sr'"),
        ("auto@", r"'auto@': the settings after '@' are empty \(''\)"),
        ("int4@sr,rounding=nearest", "rounding is given twice"),
        ("auto@25%,6GiB", "two budgets, 25% and '6GiB'"),
        ("auto@-5%", "'-5%'"),
    ],
)
def test_form_errors(text, match):
    with pytest.raises(ValueError, match=match):
        spec.parse(text)


def test_empty_spec_names_the_valid_choices():
    with pytest.raises(ValueError, match="got '  '; valid strategies: a, b"):
        spec.parse("  ", ["a", "b"])


@pytest.mark.parametrize(
    "text, match",
    [
        ("int4@fast", r"'fast' must be 'sr' or key=value with key one of rounding, group_size"),
        ("int4@speed=1", r"unknown option 'speed': 'speed=1' must be .*key one of rounding"),
        ("int4@group_size=big", r"bad value for group_size: group_size must be int, got 'big'"),
        ("int4@25%", r"int4 takes no budget \(25%\)"),
        ("recompute@1", r"'recompute@1': recompute takes no settings"),
        ("auto@25", r"budget '25' has no unit: use '25%'"),
        ("auto@25%,cache", r"'cache' must be a budget .* or key=value with key one of layers"),
        ("chunked-ce@lots", r"'lots' must be a chunk size \(an int\) or a mode"),
        ("compiled-int8@fast", r"must be compile's region budget, a number in \[0, 1\] or 'sr'"),
        ("prac@t1=x", r"t1 must be int, got 'x'"),
        ("auto@25%,reform=maybe", r"reform must be true or false, got 'maybe'"),
        ("nope@1", r"unknown strategy 'nope@1'; valid strategies: none"),
    ],
)
def test_setting_errors_name_the_value_and_the_choices(text, match):
    with pytest.raises(ValueError, match=match):
        resolve(text)


def test_configs_from_parts():
    (i,) = resolve("int8@sr,group_size=32")
    assert (i.rounding, i.group_size, i.act) == ("stochastic", 32, "int8")
    assert resolve("int8@sr")[0].name == "int8@sr"
    (c,) = resolve("compiled-outlier-int4@0.25,sr")  # an earlier name, read as today's
    assert (c.codec, c.budget, c.name) == ("int4-outlier-sr", 0.25, "compiled-int4-outlier@0.25,sr")
    (inv,) = resolve("invact-act@ops=none")
    assert inv.ops == () and inv.norms is False
    (a,) = resolve("auto@6GiB,codecs=int4/int8,max_grad_err=none")
    assert a.budget.total == 6 * 2**30 and a.codecs == ("int4", "int8") and a.max_grad_err is None


def test_spec_rewrites_print_canonical_parts():
    assert compiled_spec("int4@rounding=stochastic") == "compiled-int4@sr"
    assert compiled_spec("invact@bf16=exact-near-branch") == (
        "invact@bf16=exact-near-branch,ops=none+compiled-none"
    )
    assert with_budget("invact+auto", "6GiB") == "invact+auto@6GiB"
    with pytest.raises(ValueError, match="'12'"):
        with_budget("auto", "12")
