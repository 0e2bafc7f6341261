"""What a codec does to the gradient, measured (the profiler's training-aware quality figure).

A codec's reconstruction error (``codecstats``) says little about training: the same relative
error is harmless in one tensor and ruins another (SDPA's output: any error swamps
``rowsum(dO * O)``; a cap on reconstruction error let ``auto@25%`` lose more gradient than
``int4``, BENCHMARKS.md §6). So the profiler runs each kind's representative
block forward and backward on its captured inputs, with the real upstream gradient of the
profiling batch (the loss's gradient at the block's output, from one backward of the whole
model): once as is, then once per lossy (storage, codec) candidate with that one storage stored
through the codec (a real ``CodecPolicy``, so shared views are encoded once, as in
training). It records, for each parameter of the block (names relative to the block) and for
the gradient at the block's input(s) (key ``INPUT``), ``1 - cos(g_codec, g_exact)``, skipping
parameters whose exact gradient norm is below 1e-6 x the block's largest (the
``slimact memory`` ``grad_cosine`` rule: the minimum cosine over parameters). The root kind
(embedding, final norm, head, loss) is measured the same way with every block bypassed: blocks
pass their input through, the last one returns its captured output as a leaf, so one run costs
the head, not the model.

A codec on the input of a recompute candidate also feeds the module's re-run in backward: that
pair is measured too, the module's forward wrapped so that its output stays exact and its
backward is that of a re-run on the codec's copy (what non-reentrant checkpointing with a codec
on its stored input does), the storage's own savers through the codec as well; storages only a
checkpoint would store (module inputs no op saves) get only these figures. Codecs that
reconstruct exactly get no figure; a codec less faithful than ``MEASURED_REL_ERR`` gets ``None``
(not worth a run; the MILP leaves it out under a gradient cap), and so do the candidates left
when ``GRAD_BUDGET_S`` seconds per kind are spent (largest storages, most faithful codecs first).
A codec whose reconstruction equals one already measured (INT4 with outlier channels where there
are none) shares its figures. The runs use the first samples of the batch that hold
``GRAD_TOKENS`` tokens. The figures land in
``Profile.meta[milp.GRAD_KEY]`` as ``{kind: {storage id: {codec: {parameter or INPUT: 1 - cos}}}}``
and ``meta[milp.GRAD_CKPT_KEY]`` as ``{kind: {storage id: {codec: {module: {...}}}}}``;
``slimact.planner.milp`` caps, per block and per parameter, their sum over the chosen codecs
(1 - cos of independent small errors adds up: about half the summed relative MSE).

A stochastic unbiased codec (the PRAC family with a random subspace: ``prac``, ``rac``) is
measured the same way, on one draw. Its figure is that draw's noise, not a bias: the mean of k
draws' gradients approaches the exact one as k grows (1 - cos about 1/k), which the loss over
steps shows too, while a deterministic codec's error repeats every step. The cap therefore
treats PRAC's variance as if it were a bias and leaves such candidates out of capped plans;
read their ``grad_err`` as noise per step (BENCHMARKS.md §4: why a per-step gradient cosine is
the wrong yardstick for an unbiased codec, and measured figures).
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from slimact import sites
from slimact.codecs.build import build_codec
from slimact.codecs.saving import CodecPolicy
from slimact.gradcheck import grad_errors as grad_errors_of
from slimact.gradcheck import one_minus_cos
from slimact.planner.codecstats import run_policy
from slimact.planner.measure import detach
from slimact.planner.plan import KindProfile, abs_path, abs_site

__all__ = ["INPUT", "grad_errors", "loss_of", "measurable"]

INPUT = "<input>"  # the key of the gradient at the block's input(s)
MEASURED_REL_ERR = 0.5  # codecs less faithful than this get no figure (the MILP excludes them)
GRAD_BUDGET_S = 120.0  # per kind: the runs stop here; llama-20m's block: ~10 s on an idle CPU
GRAD_TOKENS = 256  # the runs use the first samples of the batch holding at least this many tokens


class _Runner:
    """One block (or the root with its blocks bypassed) as fwd+bwd -> (param grads, input grads)."""

    def __init__(self, prof: Any, rep: str):
        self.prof, self.rep = prof, rep
        self.module = prof.modules[rep] if rep else prof.model
        inner = set() if rep else {id(p) for b in prof.blocks for p in prof.modules[b].parameters()}
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        named = [(n, p) for n, p in named if id(p) not in inner]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        batch = int(prof.input_ids.shape[0]) if prof.input_ids.dim() > 1 else 1
        seq = int(prof.input_ids.shape[-1])
        rows = min(batch, max(1, math.ceil(GRAD_TOKENS / max(seq, 1))))
        cut = partial(_rows, batch=batch, rows=rows)
        if rep:
            args, kwargs, _ = prof.captured[rep]
            self.args = tuple(cut(a) for a in args)
            self.kwargs = {k: cut(v) for k, v in kwargs.items()}
            self.upstream = cut(prof.out_grads[rep])
        else:
            self.ids, self.targets = cut(prof.input_ids), cut(prof.targets)
            self.last_out = cut(prof.last_out)

    def _bypass(self, stack: ExitStack) -> list[torch.Tensor]:
        """Root run: blocks pass their first argument through; the last returns a leaf copy of
        its captured output (the head's input). Returns [that leaf]."""
        prof = self.prof
        last = prof.blocks[-1]
        leaf = self.last_out.detach().clone().requires_grad_(True)
        for b in prof.blocks:
            m = prof.modules[b]
            own = m.__dict__.get("forward")
            m.forward = (lambda *a, **k: leaf) if b == last else _passthrough
            stack.callback(_restore, m, own)
        return [leaf]

    def __call__(self, assign=None, ckpt=None) -> tuple[list, list]:  # type: ignore[no-untyped-def]
        """``assign``: the codec policy's rule; ``ckpt``: (module, its input positions, codec):
        that module recomputed in backward from the codec's copy of those inputs."""
        with ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.random.fork_rng(devices=[]))
            torch.manual_seed(0)  # dropout: the same masks in every run
            if assign is not None:
                stack.enter_context(sites.tracking(self.prof.model))
                stack.enter_context(sites.policy(CodecPolicy(assign)))
            if ckpt is not None:
                module, positions, codec = ckpt
                own = module.__dict__.get("forward")
                module.forward = partial(_lossy_recompute, module.forward, self.prof.skip,
                                         positions, codec)  # fmt: skip
                stack.callback(_restore, module, own)
            if self.rep:
                a = [detach(x) for x in self.args]
                kw = {k: detach(v) for k, v in self.kwargs.items()}
                ins = [x for x in (*a, *kw.values()) if isinstance(x, torch.Tensor)]
                ins = [x for x in ins if x.requires_grad]
                out = self.module(*a, **kw)
                up = self.upstream
            else:
                ins = self._bypass(stack)
                p = self.prof
                result = p.model(self.ids, **{p.label: self.targets})
                out, up = loss_of(result), None
                if out is None:
                    raise ValueError("the model's output holds no scalar loss")
        gs = torch.autograd.grad(out, [*ins, *self.params], up, allow_unused=True)
        return list(gs[len(ins) :]), list(gs[: len(ins)])


def _lossy_recompute(forward, skip: set, positions: set, codec, *args, **kwargs):  # type: ignore[no-untyped-def]
    """``forward`` as non-reentrant checkpointing with a codec on its stored inputs runs it: the
    output is the exact one, its backward that of a re-run on the codec's copy of the inputs at
    ``positions`` (tensor arguments that are not parameters or buffers, in order)."""
    cpu = torch.get_rng_state()
    gpu = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    with torch.no_grad():
        exact = forward(*args, **kwargs)
    torch.set_rng_state(cpu)  # the re-run draws the same dropout masks, as checkpointing's does
    if gpu is not None:
        torch.cuda.set_rng_state_all(gpu)
    j = 0

    def lossy(a: Any) -> Any:
        nonlocal j
        if not isinstance(a, torch.Tensor) or sites.storage_key(a) in skip:
            return a
        j += 1
        if j - 1 not in positions:
            return a
        copy = run_policy(codec, [("checkpoint", a.detach())])[0].unpack()
        return a + (copy - a).detach()  # the copy's values, the exact input's gradient path

    args = tuple(lossy(a) for a in args)
    kwargs = {k: lossy(v) for k, v in kwargs.items()}
    out = forward(*args, **kwargs)
    if isinstance(out, torch.Tensor) and isinstance(exact, torch.Tensor):
        return out + (exact - out).detach()
    return out


def _rows(v: Any, batch: int, rows: int) -> Any:
    """The first ``rows`` samples of a batch-major tensor (dim 0 == ``batch``), as a copy."""
    if rows < batch and isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch:
        return v.detach()[:rows].clone().requires_grad_(v.requires_grad and v.is_floating_point())
    return v


def _passthrough(*args: Any, **kwargs: Any) -> Any:
    return args[0] if args else next(iter(kwargs.values()))


def _restore(m: nn.Module, own: Any) -> None:
    if own is None:
        m.__dict__.pop("forward", None)
    else:
        m.forward = own


def loss_of(result: Any) -> torch.Tensor | None:
    loss = result if isinstance(result, torch.Tensor) else getattr(result, "loss", None)
    ok = isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad
    return loss if ok else None


def measurable(prof: Any, rep: str) -> bool:
    """Can ``rep`` (a block, or "" for the root) be run alone with a known upstream gradient?"""
    if rep:
        return rep in prof.captured and rep in getattr(prof, "out_grads", {})
    return bool(prof.blocks) and isinstance(getattr(prof, "last_out", None), torch.Tensor)


def _errors(names: list[str], ref: tuple[list, list], got: tuple[list, list]) -> dict:
    (rp, ri), (gp, gi) = ref, got
    out = {n: e for n, e in zip(names, grad_errors_of(gp, rp)) if e is not None}
    pairs = [(g, r) for r, g in zip(ri, gi) if r is not None and g is not None]
    out[INPUT] = max((one_minus_cos(g, r) for g, r in pairs), default=0.0)
    return {k: float(f"{v:.4g}") for k, v in out.items()}


def grad_errors(prof: Any, kp: KindProfile, rep: str) -> tuple[dict, dict]:
    """``({storage id: {codec: figures}}, {storage id: {codec: {module: figures}}})``, figures
    ``{parameter or INPUT: 1 - cos}``: the lossy codecs of ``kp``'s storages as stored by their
    sites, and as the input of a recompute candidate (the module re-run in backward from the
    codec's copy, its savers' saves through the codec too); see the module docstring. ``None``
    for a codec less faithful than ``MEASURED_REL_ERR`` (not worth a run: out under a gradient
    cap); nothing where the kind cannot be run alone. Runs stop after ``GRAD_BUDGET_S`` seconds,
    largest storages first; candidates left over get no entry (``max_rel_err`` alone)."""
    if not measurable(prof, rep):
        return {}, {}
    run = _Runner(prof, rep)
    t0 = time.perf_counter()
    try:
        ref = run()
    except (RuntimeError, TypeError, ValueError):  # an unusual block signature: no figures
        return {}, {}
    alone: dict[str, dict[str, dict | None]] = {}
    ckpt: dict[str, dict[str, dict[str, dict]]] = {}
    for s in sorted(kp.storages, key=lambda s: -s.bytes):
        names = {abs_site(x, rep) for x in s.sites if x != "!extern"}
        lossy = [c for c, st in s.codecs.items() if st.rel_err > 0]
        view = next((prof.views[n] for n in sorted(names) if n in prof.views), None)
        view = prof.views.get(f"{rep}|{s.name}") if view is None else view
        holders = [m for m in kp.modules if s.id in m.inputs]
        if not lossy or view is None or not (names or holders):
            continue
        key, seen = str(s.id), []  # seen: (reconstruction, codec) of the codecs measured
        for c in sorted(lossy, key=lambda c: s.codecs[c].rel_err):  # most faithful first
            if s.codecs[c].rel_err > MEASURED_REL_ERR or time.perf_counter() - t0 > GRAD_BUDGET_S:
                if names:
                    alone.setdefault(key, {})[c] = None
                for m in holders:
                    ckpt.setdefault(key, {}).setdefault(c, {})[m.path] = None
                continue
            codec = build_codec(c, view)
            assign = lambda site, t, c=codec, n=names: c if site in n else None  # noqa: E731
            try:
                with torch.no_grad():
                    dec = run_policy(codec, [("view", view)])[0].unpack()
                twin = next(
                    (d for t, d in seen if t.shape == dec.shape and torch.equal(t, dec)), ""
                )
                if twin:  # the same reconstruction as a codec measured: the same figures
                    if names:
                        alone.setdefault(key, {})[c] = alone.get(key, {}).get(twin)
                    if holders:
                        ckpt.setdefault(key, {})[c] = dict(ckpt.get(key, {}).get(twin, {}))
                    continue
                if names:
                    alone.setdefault(key, {})[c] = _errors(run.names, ref, run(assign))
                for m in holders:
                    at = {j for j, i in enumerate(m.inputs) if i == s.id}
                    mod = prof.modules[abs_path(m.path, rep)]
                    got = _errors(run.names, ref, run(assign, (mod, at, codec)))
                    ckpt.setdefault(key, {}).setdefault(c, {})[m.path] = got
                seen.append((dec, c))
            except (RuntimeError, TypeError, ValueError, NotImplementedError):
                continue
    return {k: v for k, v in alone.items() if v}, ckpt
