"""The planner's data: the measured ``Profile`` and the chosen ``Plan``, both plain JSON.

Names are *block-relative*: a block's site ``layers.3.mlp.act_fn:silu#0`` is ``mlp.act_fn:silu#0``
and its module ``layers.3.mlp`` is ``mlp`` (``""`` is the block itself), so one block's profile
describes every block of its *kind*. Outside the blocks (embedding, final norm, head, loss) is
the kind ``(root)`` with one instance, block ``""``, whose names are absolute.

A **storage** (the unit of memory) lists the sites that save it; ``[]`` marks a *virtual*
storage: a module input no op saves, stored only if a checkpoint of that module keeps it.
``"!extern"`` marks a saver in another block (such a storage is never dropped nor encoded).

A **Plan** gives every block a ``LayerPlan``: the modules it recomputes (non-reentrant
checkpointing), the modules it reformulates (invact; the block itself for a block
reformulation such as ``cola-m``, ``reform_kinds``), and the codec of each encoded storage,
listed with every site that saves it (checkpoint inputs ``<module>:checkpoint_input#k``
included), plus predicted bytes and added time. ``Plan`` is a ``StrategyConfig``, so
``slimact.apply(model, plan)`` applies it; ``Plan.site_actions()`` is the flat site -> action map.

A plan may also carry **lazy rules** (``SiteRule``, ``slimact.planner.rules``): a decision that
needs the first save, for the sites of the modules the rule names (``modules``; None: all). A rule
maps a saved tensor's role (``slimact.classify.site_role``: act / qk / qkv / scores / mask, read from
the site name and the tensor) to a codec label (``int4-outlier-g16``, ``int4-asym/g16``); the
runtime builds the codec on the first save of each role and channel count. The fixed-rule codec
strategies (``int4``, ``int4-plain``, ``int4-paper``, ``int4-naive``, ``int8``) are plans with one
rule and no layers. Sites a layer encodes are decided by its table; the rules decide the rest.

How each family of actions computes is the plan's **settings** (``Plan.settings``, typed,
``slimact.planner.settings``): ``recompute`` (``preserve_rng_state``), ``invact`` (the inverted
ops' mode, variant, bf16, ...), ``chunked-ce`` (chunk size, mode); only what differs from the
defaults is stated, and a plan saved without settings loads with the defaults.

Two plans merge (``Plan.merge``, ``plan_a + plan_b``) where their actions can hold together on
one model; every site where they cannot (two codecs, a codec on a tensor the other plan never
saves) and every family both act with under two settings is named in one error.

``slimact.planner.solve.solve_plan(profile, budget)`` runs the MILP (``slimact.planner.milp``)
and turns its decisions into a ``Plan``.

Budgets are ``slimact.budget.Budget`` (a share of the baseline, or device memory); a plan stores
its budget's canonical text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from slimact import actions, spec
from slimact.budget import Budget
from slimact.planner import settings as _settings
from slimact.planner.jsonread import (
    abs_path,
    abs_site,
    as_list,
    as_object,
    check_budget_text,
    check_layers,
    checked_layer,
    inside,
    near_key,
    read_entry,
    site_module,
)
from slimact.planner.jsonread import rel_site as rel_site  # (re-exported: a site's names)
from slimact.planner.rules import SiteRule, rule_conflicts
from slimact.registry import StrategyConfig
from slimact.utils import fmt_bytes

ROOT = "(root)"


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@dataclass
class CodecStat:
    bytes: int
    encode_s: float
    decode_s: float
    rel_err: float
    sqnr_db: float


@dataclass
class StorageProfile:
    """One stored tensor of a block; ``sites`` are block-relative (first = owner), [] = virtual."""

    id: int
    name: str
    sites: list[str]
    bytes: int
    shape: list[int]
    dtype: str
    lossy_ok: bool
    codecs: dict[str, CodecStat] = field(default_factory=dict)


@dataclass
class ModuleProfile:
    path: str  # block-relative; "" is the block itself
    type: str
    inputs: list[int]  # storage ids of its tensor arguments, in checkpoint order
    recompute_s: float
    flops: int


@dataclass
class ReformProfile:
    path: str
    kind: str  # "invact:silu", "invnorm:rms" ...
    silenced: list[str]  # baseline sites it no longer saves
    added: list[int]  # storages that gain a saver (its output, saved by the inverted op)
    extra_bytes: int  # new storages (bit mask, rstd)
    delta_s: float  # fwd+bwd time of the inverted module minus the original's
    saver_sites: dict[str, list[str]] = field(default_factory=dict)  # added sid -> new sites


@dataclass
class KindProfile:
    kind: str
    blocks: list[str]
    storages: list[StorageProfile]
    modules: list[ModuleProfile]
    reforms: list[ReformProfile]
    # block -> storage id (str) -> {"raw": bytes, codec: bytes, "outliers": n}
    per_block: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)

    def bytes_of(self, block: str, sid: int, option: str) -> int:
        """Bytes of storage ``sid`` in ``block`` under ``option`` ('raw' or a codec name)."""
        if option.startswith("offload"):  # in host memory (``slimact.planner.offload``)
            return 0
        got = self.per_block.get(block, {}).get(str(sid), {}).get(option)
        if got is not None:
            return int(got)
        s = self.storages[sid]
        return s.bytes if option == "raw" else s.codecs[option].bytes


@dataclass
class Profile:
    model: str
    batch: int
    seq: int
    dtype: str
    device: str
    baseline_bytes: int
    static: dict[str, int]
    kinds: list[KindProfile]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_blocks(self) -> int:
        return sum(len(k.blocks) for k in self.kinds if k.kind != ROOT)

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        write_atomic(path, json.dumps(self.to_dict()))

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        kinds = []
        for k in d["kinds"]:
            storages = [
                StorageProfile(
                    **{**s, "codecs": {n: CodecStat(**c) for n, c in s["codecs"].items()}}
                )
                for s in k["storages"]
            ]
            kinds.append(
                KindProfile(
                    k["kind"],
                    k["blocks"],
                    storages,
                    [ModuleProfile(**m) for m in k["modules"]],
                    [ReformProfile(**r) for r in k["reforms"]],
                    k.get("per_block", {}),
                )
            )
        return cls(**{**d, "kinds": kinds})

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_dict(json.loads(Path(path).read_text()))


# ---------------------------------------------------------------------------------------------
# budgets


def parse_budget(text: str | int | Budget, baseline_bytes: int, static_bytes: int = 0) -> int:
    """Activation bytes allowed by a budget (``slimact.budget.Budget``; text or int parsed)."""
    return spec.parse_budget(text).allowed(baseline_bytes, static_bytes)


# ---------------------------------------------------------------------------------------------
# plans


@dataclass(frozen=True)
class LayerPlan:
    """The actions of one block (``block == ""``: outside the blocks)."""

    block: str
    kind: str
    recompute: tuple[str, ...] = ()
    reform: tuple[str, ...] = ()
    codecs: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (codec, block-relative sites)
    storages: tuple[tuple[str, str, int, int], ...] = ()  # (storage, action, bytes, predicted)
    baseline_bytes: int = 0
    predicted_bytes: int = 0
    predicted_time_s: float = 0.0
    reform_kinds: tuple[tuple[str, str], ...] = ()  # (reformulated module, its kind)

    def __post_init__(self) -> None:  # rows speak slimact.actions' vocabulary (old plans too)
        for name, value in checked_layer(self).items():  # (jsonread: a wrong one names itself)
            object.__setattr__(self, name, value)

    def reform_action(self, path: str) -> str:
        kind = dict(self.reform_kinds).get(path)
        return actions.reformulate(actions.reform_op(kind) if kind else "inverted")

    def signature(self) -> tuple:
        return (self.kind, self.recompute, self.reform, tuple(s[:2] for s in self.storages))


@dataclass(frozen=True)
class Plan(StrategyConfig):
    """A solved plan; ``slimact.apply(model, plan)`` applies it (see the module docstring)."""

    model: str = ""
    batch: int = 0
    seq: int = 0
    dtype: str = ""
    budget: str = ""
    budget_bytes: int = 0  # activation bytes the solver was allowed
    baseline_bytes: int = 0
    static_bytes: int = 0
    predicted_bytes: int = 0
    predicted_time_s: float = 0.0
    min_feasible_bytes: int = 0
    solve_s: float = 0.0
    layers: tuple[LayerPlan, ...] = ()
    meta: tuple[tuple[str, Any], ...] = ()
    rules: tuple[SiteRule, ...] = ()  # lazy rules, in order: the first with a codec decides
    # family -> how its actions compute (``planner.settings``; a dict is accepted): non-defaults
    settings: tuple[tuple[str, _settings.Settings], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "settings", _settings.normalize(self.settings))
        check_budget_text(self.budget)
        for layer in self.layers:
            if not isinstance(layer, LayerPlan):
                raise ValueError(f"a plan's layers are LayerPlan's, got {layer!r:.200}")

    def setting(self, family: str) -> _settings.Settings:
        """How ``family``'s actions compute in this plan (``planner.settings``)."""
        return dict(self.settings).get(family) or _settings.default(family)

    def uses(self, family: str) -> bool:
        """Does the plan act with ``family`` (its settings matter)? ``recompute``: a module
        recomputed or a block reformulated whole (``cola-m`` recomputes inside); ``invact``,
        ``chunked-ce``: a module reformulated with a kind of the family (a module of no kind,
        from a plan saved before kinds: either)."""
        if family in dict(self.settings):
            return True
        kinds = _settings.FAMILIES[family].reform_kinds
        for lp in self.layers:
            if family == "recompute" and (lp.recompute or (lp.block and "" in lp.reform)):
                return True
            named = dict(lp.reform_kinds)
            for path in lp.reform:
                kind = named.get(path, "").partition(":")[0]
                if kind in kinds or (not kind and family != "recompute"):
                    return True
        return False

    def layer(self, block: str) -> LayerPlan | None:
        for lp in self.layers:
            if lp.block == block:
                return lp
        return None

    def site_actions(self) -> dict[str, str]:
        """Every planned site (absolute name) and module (``<path>:``) -> its action, in
        ``slimact.actions``' words: keep / recompute / codec:<name> / reformulate:<op>."""
        out: dict[str, str] = {}
        for lp in self.layers:
            for path in lp.recompute:
                out[abs_path(path, lp.block) + ":"] = actions.RECOMPUTE
            for path in lp.reform:
                out[abs_path(path, lp.block) + ":"] = lp.reform_action(path)
            for name, action, _, _ in lp.storages:
                out[abs_site(name, lp.block)] = action
            for codec, sites_ in lp.codecs:
                for s in sites_:
                    out[abs_site(s, lp.block)] = actions.codec(codec)
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["meta"] = dict(self.meta)
        d["settings"] = _settings.settings_to_dict(self.settings)
        d["site_actions"] = self.site_actions()
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> None:
        write_atomic(path, self.to_json())

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        """Inverse of :meth:`to_dict` (``site_actions`` is derived and ignored); what is not a
        plan's JSON (a layer or rule of unknown or missing fields, a field of the wrong shape) is
        a ``ValueError`` naming it."""
        if not isinstance(d, dict):
            raise ValueError(f"a plan's JSON is an object of Plan's fields, got {d!r:.200}")
        names = {f.name for f in fields(cls)}
        for k in d:  # other keys are carried beside a plan (``slimact plan --json``'s timings)
            near = near_key(str(k), sorted(names))
            if k not in names and near:
                raise ValueError(
                    f"a plan's JSON has key {k!r}, not a field of Plan: did you mean {near[0]!r}? "
                    f"(its fields: {', '.join(sorted(names))})"
                )
        d = {k: v for k, v in d.items() if k in names}
        layers = tuple(
            read_entry("layers", LayerPlan, _layer_fields, lp) for lp in as_list(d, "layers")
        )
        rules = tuple(read_entry("rules", SiteRule, dict, r) for r in as_list(d, "rules"))
        meta = tuple(dict(d.get("meta") or {}).items())
        settings = _settings.settings_from_dict(as_object(d, "settings"))
        return cls(**{**d, "layers": layers, "meta": meta, "rules": rules, "settings": settings})

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def check_against(self, model: Any, saved: Collection[str] | None = None) -> None:
        """Does every entry of the plan name something of ``model``? A ``ValueError`` names
        every one that does not, with the nearest valid names (``jsonread.check_layers``: a
        block or module that is not one of the model's, a codec on a site never saved there);
        ``saved``: the sites one forward of the planned model saved, to check each codec's op
        and ordinal too (``strategies/auto.py``'s ``saved_sites``, at ``apply``)."""
        problems = check_layers(self.layers, [p for p, _ in model.named_modules()], saved)
        if problems:
            raise ValueError(
                f"plan for {self.model or 'a model'!r} does not match this "
                f"{type(model).__name__}:\n  " + "\n  ".join(problems)
            )

    def merge(self, other: Plan) -> Plan:
        """Both plans' actions on one model (``plan_a + plan_b``): per block, the union of what
        each recomputes, reformulates and encodes, then ``self``'s rules before ``other``'s.

        ``keep`` is no action, so it never conflicts. Everything else that cannot hold together
        is refused, every such site named in one ``ValueError``: two codecs on one site, one
        module both recomputed and reformulated, a codec on a site inside a module the other plan
        recomputes or reformulates (its tensor would never be saved, so the codec would silently
        do nothing), blocks of different kinds, two rules for the same modules that give one
        role two codecs or decide by different roles (site roles and PRAC's; rules for disjoint
        modules, e.g. two ``filter_fn``'s, hold together: INT4 here, INT8 there), plans of two
        different models, two settings of one family both plans act with (``planner.settings``:
        ``invact@bf16=exact-near-branch`` and ``invact``). A merged plan is not solved: it predicts nothing (its bytes are the
        meter's to measure).
        """
        if not isinstance(other, Plan):
            raise TypeError(f"a Plan merges with a Plan, not {type(other).__name__}")
        problems: list[str] = []
        if self.model and other.model and self.model != other.model:
            problems.append(f"plans of two models: {self.model!r} and {other.model!r}")
        mine = {lp.block: lp for lp in self.layers}
        theirs = {lp.block: lp for lp in other.layers}
        layers = []
        for block in [*mine, *(b for b in theirs if b not in mine)]:
            a, b = mine.get(block), theirs.get(block)
            if a is None or b is None:
                layers.append(a or b)
                continue
            layers.append(_merge_layers(a, b, problems))
        problems += rule_conflicts((*self.rules, *other.rules))
        settings = _merge_settings(self, other, problems)
        if problems:
            raise ValueError("the plans conflict:\n  " + "\n  ".join(problems) + _MERGE_HINT)
        return Plan(
            model=self.model or other.model,
            batch=self.batch or other.batch,
            seq=self.seq or other.seq,
            dtype=self.dtype or other.dtype,
            baseline_bytes=max(self.baseline_bytes, other.baseline_bytes),
            static_bytes=max(self.static_bytes, other.static_bytes),
            layers=tuple(layers),
            meta=(("merged", [_plan_name(self), _plan_name(other)]),),
            rules=(*self.rules, *other.rules),
            settings=settings,
        )

    def __add__(self, other: Plan) -> Plan:
        return self.merge(other)

    def table(self) -> str:
        """Per distinct layer plan: its storages' actions; then the predicted totals."""
        groups: dict[tuple, list[LayerPlan]] = {}
        for lp in self.layers:
            groups.setdefault(lp.signature(), []).append(lp)
        lines = []
        for lps in groups.values():
            lp = lps[0]
            names = ", ".join(p.block or "(outside blocks)" for p in lps)
            lines.append(f"== {names}  [{lp.kind}]")
            for path in lp.recompute:
                lines.append(f"   {path or '(whole block)'}: {actions.RECOMPUTE}")
            for path in lp.reform:
                lines.append(f"   {path or '(whole block)'}: {lp.reform_action(path)}")
            if not (lp.storages or lp.baseline_bytes):  # a preset's row: actions, no storages
                continue
            lines.append(f"   {'storage':<44} {'action':<26} {'bytes':>11} {'planned':>11}")
            for name, action, before, after in lp.storages:
                lines.append(
                    f"   {name:<44} {action:<26} {fmt_bytes(before):>11} {fmt_bytes(after):>11}"
                )
            lines.append(
                f"   per block: {fmt_bytes(lp.baseline_bytes)} -> {fmt_bytes(lp.predicted_bytes)}"
                f", +{lp.predicted_time_s * 1e3:.2f} ms"
            )
        for rule in self.rules:
            lines.extend(rule.table_lines())
        for family, value in self.settings:
            lines.append(f"== settings of {family}: {_settings.differences(value)}")
        ratio = self.predicted_bytes / self.baseline_bytes if self.baseline_bytes else 0.0
        described = dict(self.meta).get("describes")
        if described:  # slimact.strategies.describe: a strategy's plan measured on one step
            lines += [
                "",
                f"model {self.model}  batch {self.batch} x seq {self.seq}  {self.dtype}",
                f"strategy {described}: activations measured {fmt_bytes(self.baseline_bytes)}"
                f" (none) -> {fmt_bytes(self.predicted_bytes)} ({ratio:.1%})",
            ]
            return "\n".join(lines)
        if not self.layers:  # rules alone (int4 ...): nothing solved, nothing predicted
            strategy = dict(self.meta).get("strategy", "")
            return "\n".join([*lines, "", f"lazy rules{f' of {strategy}' if strategy else ''}"])
        if not (self.baseline_bytes or self.budget_bytes):  # a preset or a merge: not solved
            strategy = dict(self.meta).get("strategy", "")
            what = f"the actions of {strategy}" if strategy else "fixed actions"
            return "\n".join([*lines, "", f"{what}; not solved, nothing predicted"])
        lines += [
            "",
            f"model {self.model}  batch {self.batch} x seq {self.seq}  {self.dtype}",
            f"budget {self.budget} -> {fmt_bytes(self.budget_bytes)} of activations"
            f"  (static {fmt_bytes(self.static_bytes)})",
            f"baseline activations {fmt_bytes(self.baseline_bytes)}   predicted "
            f"{fmt_bytes(self.predicted_bytes)} ({ratio:.1%})   smallest feasible "
            f"{fmt_bytes(self.min_feasible_bytes)}",
            f"predicted added time {self.predicted_time_s * 1e3:.2f} ms/step   "
            f"solve {self.solve_s * 1e3:.1f} ms",
        ]
        meta = dict(self.meta)
        if "host_bytes" in meta:  # offload (slimact.planner.offload)
            lines.append(
                f"offloaded to host memory {fmt_bytes(meta['host_bytes'])} of host budget "
                f"{fmt_bytes(meta['host_budget'])}   link {meta['link_bandwidth'] / 1e9:.1f} GB/s"
            )
        return "\n".join(lines)


def _layer_fields(lp: dict) -> dict:
    return {
        **lp,
        "recompute": lp["recompute"],  # checked and made tuples by LayerPlan itself
        "reform": lp["reform"],
        "codecs": lp["codecs"],
        "storages": lp["storages"],
        "reform_kinds": tuple(tuple(r) for r in lp.get("reform_kinds", ())),
    }


# ---------------------------------------------------------------------------------------------
# merging (Plan.merge)


_MERGE_HINT = (
    "\nto keep both, give each its own modules (a filter_fn per part: slimact.apply(model, "
    "spec, filter_fn), plan_of(model, spec, filter_fn)); to replace what a model runs, "
    "slimact.revert(model) first"
)


def _plan_name(plan: Plan) -> str:
    meta = dict(plan.meta)
    return str(meta.get("strategy") or meta.get("describes") or plan.budget or "plan")


def _merge_settings(a: Plan, b: Plan, problems: list[str]) -> dict[str, _settings.Settings]:
    """Both plans' settings (``Plan.merge``): a family both act with must have one setting."""
    out = {}
    for family in _settings.FAMILIES:
        sa, sb = a.setting(family), b.setting(family)
        ua, ub = a.uses(family), b.uses(family)
        if ua and ub and sa != sb:
            problems.append(
                f"the plans set {family} two ways: {_settings.differences(sa)} in "
                f"{_plan_name(a)} and {_settings.differences(sb)} in {_plan_name(b)}"
            )
        out[family] = sb if ub and not ua else sa if sa != _settings.default(family) else sb
    return out


def _merge_layers(a: LayerPlan, b: LayerPlan, problems: list[str]) -> LayerPlan:
    """One block's two layer plans as one (``Plan.merge``); conflicts appended to ``problems``."""
    where = a.block or "(outside blocks)"
    if a.kind != b.kind:
        problems.append(f"block {where} is a {a.kind} in one plan and a {b.kind} in the other")
        return a
    recompute = tuple(dict.fromkeys((*a.recompute, *b.recompute)))
    reform = tuple(dict.fromkeys((*a.reform, *b.reform)))
    for path in set(recompute) & set(reform):
        name = abs_path(path, a.block) or "(the whole block)"
        problems.append(f"module {name} is recomputed in one plan and reformulated in the other")
    codec_of: dict[str, str] = {}
    for lp, rest in ((a, b), (b, a)):
        for codec, names in lp.codecs:
            for site in names:
                full = abs_site(site, a.block)
                if codec_of.setdefault(site, codec) != codec:
                    problems.append(f"two codecs on {full}: {codec_of[site]} and {codec}")
                op = site.rpartition(":")[2].split("#")[0]
                if op == "checkpoint_input" or op in actions.REFORMULATED_OPS:
                    continue  # saved by the recomputation / by the reformulated op itself
                for path, verb in [(p, "recomputes") for p in rest.recompute] + [
                    (p, "reformulates") for p in rest.reform
                ]:
                    if inside(site_module(site), path):
                        module = abs_path(path, a.block) or "the whole block"
                        problems.append(
                            f"codec {codec} on {full}, inside {module}, which the other plan "
                            f"{verb}: the tensor is never saved there"
                        )
    codecs: dict[str, list[str]] = {}
    for site, codec in codec_of.items():
        codecs.setdefault(codec, []).append(site)
    rows: dict[str, tuple[str, str, int, int]] = {}
    for row in (*a.storages, *b.storages):
        if row[0] not in rows or rows[row[0]][1] == actions.KEEP:
            rows[row[0]] = row
    return LayerPlan(
        block=a.block,
        kind=a.kind,
        recompute=recompute,
        reform=reform,
        codecs=tuple((c, tuple(s)) for c, s in codecs.items()),
        storages=tuple(rows.values()),
        baseline_bytes=max(a.baseline_bytes, b.baseline_bytes),
        reform_kinds=_merge_kinds(a.reform_kinds, b.reform_kinds),
    )


def _merge_kinds(a: tuple, b: tuple) -> tuple[tuple[str, str], ...]:
    """Both plans' (module, reformulation kind) rows; PRAC's fused RMSNorm (``rms-norm``) yields
    to another reformulation of the same norm (``invact+prac``: the inverted norm stays)."""
    kinds: dict[str, str] = {}
    rows = []
    for path, kind in dict.fromkeys((*a, *b)):
        old = kinds.get(path)
        if old is not None and kind == actions.FUSED_RMS:
            continue
        if old == actions.FUSED_RMS:
            rows.remove((path, old))
        kinds[path] = kind
        rows.append((path, kind))
    return tuple(rows)


# ---------------------------------------------------------------------------------------------
# solving (the MILP itself is slimact.planner.milp)
