"""Reading a plan's JSON (``Plan.from_dict``) and checking it against a model: what is
malformed or names nothing real is a ``ValueError`` naming it.

A saved plan is read by hand or by a program of the user's; a wrong shape (a rule that is not an
object, a layer missing a field, ``settings`` given as a list, ``"recompute": "mlp"``, a codec
given as ``5``), an unknown action or codec label, a budget out of range or a misspelled
top-level key (``near_key``: ``lyaers``) must say which entry is wrong and what it should hold,
not surface as a ``KeyError`` or ``AttributeError`` from inside the reader, nor at the first
forward. ``check_layers`` (``Plan.check_against``, called at ``apply``) holds a plan's entries
against the model's modules and, given them, the sites one forward of the planned model saved:
a plan that codes a site that does not exist would otherwise apply and silently do less than it
says. The site-name helpers (``abs_site``, ``site_module`` ...) live here; ``planner.plan``
re-exports them.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Collection, Iterable
from dataclasses import fields
from typing import Any

from slimact import actions, spec
from slimact.codecs.base import codec_config, codec_names


def as_list(d: dict, key: str) -> list:
    """``d[key]`` (absent: ``[]``), a JSON list."""
    value = d.get(key, [])
    if not isinstance(value, list | tuple):
        raise ValueError(f"a plan's {key!r} is a list, got {value!r:.200}")
    return list(value)


def as_object(d: dict, key: str) -> dict:
    """``d[key]`` (absent: ``{}``), a JSON object."""
    value = d.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"a plan's {key!r} is an object, got {value!r:.200}")
    return value


def read_entry(key: str, cls: type, convert: Callable[[dict], dict], entry: Any) -> Any:
    """One entry of a plan's ``key`` list (``layers``, ``rules``) as ``cls(**convert(entry))``;
    a malformed one (not an object, a field unknown or missing, a field of the wrong shape) a
    ``ValueError`` naming it and ``cls``'s fields."""
    try:
        if not isinstance(entry, dict):
            raise TypeError("not an object")
        return cls(**convert(entry))
    except (KeyError, TypeError) as e:
        valid = ", ".join(f.name for f in fields(cls))
        raise ValueError(
            f"a plan's {key!r} entry {entry!r:.200} is no {cls.__name__} ({type(e).__name__}: "
            f"{e}); its fields: {valid}"
        ) from e


# ---------------------------------------------------------------------------------------------
# names (block-relative, see ``planner.plan``)


def rel_site(site: str, block: str) -> str:
    """``layers.0.mlp:silu#0`` -> ``mlp:silu#0`` for block ``layers.0`` (root: unchanged)."""
    if not block:
        return site
    return site[len(block) + 1 :] if site.startswith(block + ".") else site[len(block) :]


def abs_site(rel: str, block: str) -> str:
    if not block:
        return rel
    return block + rel if rel.startswith(":") else f"{block}.{rel}"


def abs_path(rel: str, block: str) -> str:
    return f"{block}.{rel}" if block and rel else (block or rel)


def inside(module: str, container: str) -> bool:
    """Is module path ``module`` equal to or below ``container`` (block-relative paths)?"""
    return not container or module == container or module.startswith(container + ".")


def site_module(site: str) -> str:
    return site.rpartition(":")[0]


# ---------------------------------------------------------------------------------------------
# checking a layer's fields, a budget's text, a plan against a model


def checked_layer(lp: Any) -> dict[str, Any]:
    """A ``LayerPlan``'s fields made tuples and checked (``LayerPlan.__post_init__``): module
    paths are lists of strings, each codec a label ``codec_config`` reads on sites named
    ``<module>:<op>#<k>``, each storage row's action one of ``slimact.actions``' (a legacy
    spelling or a bare codec label read as such)."""
    where = f"plan layer {lp.block or '(outside blocks)'!r}"
    out: dict[str, Any] = {}
    for name in ("recompute", "reform"):
        paths = getattr(lp, name)
        if not isinstance(paths, tuple | list) or not all(isinstance(p, str) for p in paths):
            raise ValueError(
                f'{where}: {name} is a list of block-relative module paths ("" for the block '
                f"itself), got {paths!r:.200}"
            )
        out[name] = tuple(paths)
    out["codecs"] = _checked_codecs(lp.codecs, where)
    if not isinstance(lp.storages, tuple | list):
        raise ValueError(f"{where}: storages is a list of rows, got {lp.storages!r:.200}")
    out["storages"] = tuple(_storage_row(row, where) for row in lp.storages)
    return out


def check_budget_text(budget: Any) -> None:
    """A plan's ``budget`` that reads as a number (not a label such as a compiled root plan's)
    is one ``slimact.spec.parse_budget`` takes: ``-5%`` or ``150%`` is refused here, not at the first step."""
    if isinstance(budget, str) and _NUMERIC.match(budget):
        try:
            spec.parse_budget(budget)
        except ValueError as e:
            raise ValueError(f"a plan's budget {budget!r} is not a budget: {e}") from None


def check_layers(
    layers: Iterable[Any], module_paths: Iterable[str], saved: Collection[str] | None = None
) -> list[str]:
    """What in a plan's ``layers`` names nothing of a model whose modules are ``module_paths``,
    one line each with the nearest valid names: a block, a recomputed or reformulated module
    that is not a module; a codec on a site whose module is not one, which lies inside a module
    the plan recomputes or reformulates (its tensor is never saved there, so the codec would do
    nothing; unless another site of its entry saves it, as a solved plan lists a storage with
    every site that shares it: a recomputed block's input, its norm's), or which is the
    checkpoint input of a module the plan does not recompute; with
    ``saved``, the sites one forward of the planned model saved, a codec on a site its module
    never saves there (``:checkpoint_input#3`` of a module called with one tensor; a module
    that saved nothing in that forward, e.g. an expert no token reached, is not judged)."""
    modules = sorted(module_paths)
    known = set(modules)
    by_module: dict[str, list[str]] = {}
    for site in saved or ():
        by_module.setdefault(site_module(site), []).append(site)
    problems: list[str] = []

    def module_named(what: str, path: str) -> bool:
        if path in known:
            return True
        near = difflib.get_close_matches(path, modules, 3, 0.5)
        hint = f"; nearest: {', '.join(map(repr, near))}" if near else ""
        problems.append(f"{what} {path!r}, which is not a module of the model{hint}")
        return False

    for lp in layers:
        if lp.block and not module_named("block", lp.block):
            continue
        recomputed = [abs_path(p, lp.block) for p in lp.recompute]
        reformed = [abs_path(p, lp.block) for p in lp.reform if p]  # not a whole block
        for full in recomputed:
            module_named("recompute", full)
        for p in lp.reform:
            module_named("reform", abs_path(p, lp.block))
        for codec, names in lp.codecs:
            hiding = {  # (a storage's sharers: a codec lists every site that saves it)
                rel: _hidden_by(
                    site_module(abs_site(rel, lp.block)),
                    rel.rpartition(":")[2].partition("#")[0],
                    recomputed,
                    reformed,
                )
                for rel in names
            }
            shared = any(not h for h in hiding.values())
            for rel in names:
                site = abs_site(rel, lp.block)
                module, op = site_module(site), rel.rpartition(":")[2].partition("#")[0]
                if not module_named(f"codec {codec} on site {site!r}: its module", module):
                    continue
                hidden = hiding[rel]
                own = by_module.get(module)
                if hidden and shared:
                    continue  # a sharer saves the storage where this site no longer does
                if hidden:
                    problems.append(
                        f"codec {codec} on site {site!r}, inside {hidden}: the tensor is never "
                        "saved there, so the codec would do nothing"
                    )
                elif (
                    op == "checkpoint_input"
                    and site not in (own or ())
                    and not (
                        module in recomputed or (lp.block and "" in lp.reform)  # (cola-m's own)
                    )
                ):
                    problems.append(
                        f"codec {codec} on site {site!r}: the plan does not recompute "
                        f"{module!r}, so no checkpoint saves its input"
                    )
                elif own and site not in own:
                    near = difflib.get_close_matches(site, own, 3, 0.0)
                    problems.append(
                        f"codec {codec} on site {site!r}, which {module!r} never saves; its "
                        f"sites: {', '.join(map(repr, near))}"
                    )
    return problems


def _hidden_by(module: str, op: str, recomputed: list[str], reformed: list[str]) -> str:
    """Where a site of ``module`` (op ``op``) is never saved under a plan that recomputes and
    reformulates these (absolute) modules: the module hiding it, in words, or ""."""
    for path in recomputed:
        if op == "checkpoint_input":  # saved by the checkpoint of its own module
            if module != path and inside(module, path):
                return f"{path or 'the model'}, which the plan recomputes"
        elif inside(module, path):
            return f"{path or 'the model'}, which the plan recomputes"
    if op == "checkpoint_input" or op in actions.REFORMULATED_OPS:
        return ""  # saved by the recomputation / by the reformulated op itself
    for path in reformed:
        if inside(module, path):
            return f"{path or 'the model'}, which the plan reformulates"
    return ""


_NUMERIC = re.compile(r"\s*[-+]?[0-9.]")  # a budget's text (not a label such as a root plan's)


def near_key(key: str, names: list[str]) -> list[str]:
    """The field ``key`` most likely misspells (difflib, at a cutoff that takes two swapped
    letters, ``lyaers``, and leaves keys carried beside a plan, ``timings``); [] for a key far
    from every field."""
    return difflib.get_close_matches(key, names, 1, 0.8)


def _checked_codecs(codecs: Any, where: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """A layer's ``codecs`` as (codec label, sites) pairs: each label one ``codec_config``
    reads, each site named ``<module>:<op>#<k>``; anything else a ``ValueError`` naming it."""
    if not isinstance(codecs, tuple | list):
        raise ValueError(
            f"{where}: codecs is a list of [codec, [sites]] pairs, got {codecs!r:.200}"
        )
    out = []
    for entry in codecs:
        if not (isinstance(entry, tuple | list) and len(entry) == 2):
            raise ValueError(f"{where}: a codecs entry is [codec, [sites]], got {entry!r:.200}")
        label, names = entry
        if not isinstance(label, str):
            raise ValueError(
                f"{where}: codec {label!r} (on {names!r:.120}) is not a codec label; a label is "
                f"a string such as {', '.join(repr(c) for c in list(codec_names())[:4])}"
            )
        try:
            codec_config(label)
        except ValueError as e:
            raise ValueError(f"{where}: codec {label!r} on {names!r:.120}: {e}") from None
        if isinstance(names, str) or not isinstance(names, tuple | list):
            raise ValueError(f"{where}: codec {label!r} takes a list of sites, got {names!r:.200}")
        for site in names:
            if not isinstance(site, str) or not _SITE.fullmatch(site):
                raise ValueError(
                    f"{where}: codec {label!r} on {site!r}, which is not a site name: a site is "
                    "'<module>:<op>#<k>', block-relative (e.g. 'mlp.down_proj:linear#0', "
                    "':checkpoint_input#0' for the block's own)"
                )
        out.append((label, tuple(names)))
    return tuple(out)


_SITE = re.compile(r"[^:#]*:[^:#]+#[0-9]+")


def _storage_row(row: Any, where: str) -> tuple[str, str, int, int]:
    """A layer's storage row (storage, action, bytes, planned bytes), its action in
    ``slimact.actions``' words: a legacy spelling or a bare codec label (what plans saved before
    the vocabulary wrote) is read as such; an unknown action or codec is a ``ValueError``."""
    if not (isinstance(row, tuple | list) and len(row) == 4):
        raise ValueError(
            f"{where}: a storages row is [storage, action, bytes, planned bytes], got {row!r:.200}"
        )
    name, text, before, after = row
    if not isinstance(text, str):
        raise ValueError(f"{where}: storage {name!r} has action {text!r}, not an action string")
    try:
        action = actions.parse(text)
    except ValueError:
        try:
            codec_config(text)
        except ValueError:
            raise ValueError(
                f"{where}: storage {name!r} has unknown action {text!r}; valid: keep, recompute, "
                f"codec:<name>, reformulate:<op>, offload, offload+codec:<name> (codecs: "
                f"{', '.join(codec_names())})"
            ) from None
        return (name, actions.codec(text), before, after)
    traced = action.detail.startswith("compiled-")  # a traced codec (``slimact.compiled``)
    if action.detail and action.kind != actions.REFORMULATE and not traced:
        try:
            codec_config(action.detail)
        except ValueError as e:
            raise ValueError(f"{where}: storage {name!r} has action {text!r}: {e}") from None
    return (name, str(action), before, after)


__all__ = [
    "abs_path",
    "abs_site",
    "as_list",
    "as_object",
    "check_budget_text",
    "check_layers",
    "checked_layer",
    "inside",
    "near_key",
    "read_entry",
    "rel_site",
    "site_module",
]
