"""One profiling pass (``profile.profile_model``, ``profile.profile_shapes``): the forward under
the meter, the captured module inputs and saved views, and per kind its storages, recompute
candidates, codec statistics, reformulations and per-block rows (see ``slimact.planner.profile``).
"""

from __future__ import annotations

import hashlib
import time
from functools import partial

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from slimact import sites
from slimact.classify import label_arg
from slimact.codecs.build import build_codec
from slimact.codecs.outlier import count_outlier_channels
from slimact.codecs.saving import hidden_channels
from slimact.meter import measure
from slimact.planner.codecstats import (
    _extreme_weights,
    _payload_bytes,
    _worth_trying,
    codec_stat,
    lossy_allowed,
    partnered_bytes,
    run_policy,
)
from slimact.planner.gradstats import grad_errors, loss_of
from slimact.planner.measure import call_module, detach, median_time
from slimact.planner.plan import (
    ROOT,
    KindProfile,
    ModuleProfile,
    StorageProfile,
    abs_site,
    inside,
    rel_site,
    site_module,
)
from slimact.planner.reforms import measure_head_reform, measure_reform, reform_candidates

__all__ = ["Profiler", "kind_signature"]


def kind_signature(module: nn.Module) -> str:
    parts = [
        (n, type(m).__name__, tuple(tuple(p.shape) for p in m.parameters(recurse=False)))
        for n, m in module.named_modules()
    ]
    digest = hashlib.sha1(repr(parts).encode()).hexdigest()[:8]
    return f"{type(module).__name__}-{digest}"


class Profiler:
    """State of one profiling pass: the captured views, module inputs and the meter's report."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        codecs: list[str],
        repeats: int,
        shapes_only: bool = False,
        slopes: bool = False,
        grads: bool = False,
    ):
        self.model, self.device, self.codecs, self.repeats = model, device, codecs, repeats
        self.shapes_only = shapes_only  # fake tensors: structure, bytes and FLOPs, no values
        self.slopes = slopes  # per codec, payload bytes per extra copy of the rows (scaled.py)
        self.grads = grads and not shapes_only  # per codec, its gradient error (gradstats.py)
        self.grad_err: dict[str, dict] = {}  # kind -> storage id -> codec -> {param: 1-cos}
        self.out_grads: dict[str, torch.Tensor] = {}  # rep block -> dLoss/d(its output)
        self.last_out: torch.Tensor | None = None  # the last block's output (the head's input)
        self.grad_ckpt: dict[str, dict] = {}  # the same, as a recomputed module's input
        self.grad_s = 0.0  # seconds spent measuring gradient errors
        self.modules = dict(model.named_modules())
        self.blocks = sites.block_paths(model)
        groups: dict[str, list[str]] = {}
        for b in self.blocks:
            groups.setdefault(kind_signature(self.modules[b]), []).append(b)
        self.groups = [*groups.items(), (ROOT, [""])]
        self.reps = [g[1][0] for g in self.groups]
        ts = (*model.parameters(), *model.buffers())
        self.skip = {sites.storage_key(t) for t in ts}
        self.views: dict[str, torch.Tensor] = {}
        self.captured: dict[str, list] = {}  # path -> [args, kwargs, output]

    def region(self, path: str) -> str | None:
        """The rep block a module is profiled in ("" = root), or None (a non-rep block)."""
        b = sites.block_of(path, self.blocks)
        if b:
            return b if b in self.reps else None
        ok = path and not isinstance(self.modules[path], (nn.ModuleList, nn.Sequential))
        return "" if ok else None

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor):
        def pre(mod, args, kwargs, path):
            if path not in self.captured:
                kw = {k: detach(v) for k, v in kwargs.items()}
                self.captured[path] = [tuple(detach(a) for a in args), kw, None]

        live: dict[str, torch.Tensor] = {}

        def post(mod, args, kwargs, out, path):
            self.captured[path][2] = out.detach() if isinstance(out, torch.Tensor) else None
            if self.grads and isinstance(out, torch.Tensor) and out.requires_grad:
                live[path] = out

        def last_post(mod, args, out):
            self.last_out = out.detach() if isinstance(out, torch.Tensor) else None

        handles = []
        for path, m in self.modules.items():
            if self.region(path) is not None:
                handles.append(
                    m.register_forward_pre_hook(partial(pre, path=path), with_kwargs=True)
                )
                handles.append(m.register_forward_hook(partial(post, path=path), with_kwargs=True))
        if self.grads and self.blocks:
            handles.append(self.modules[self.blocks[-1]].register_forward_hook(last_post))
        self.input_ids, self.targets = input_ids, targets
        self.label = (label_arg(self.model) or ("targets", 1))[0]  # HF: labels
        listen = lambda ev: self.views.setdefault(ev.site, detach(ev.tensor))  # noqa: E731
        try:
            with torch.enable_grad(), measure(self.model, input_ids.numel()) as meter:
                with sites.listening(listen):  # fake ids have no values to check
                    call = (
                        partial(nn.Module.__call__, self.model) if self.shapes_only else self.model
                    )
                    result = call(input_ids, **{self.label: targets})
        finally:
            for h in handles:
                h.remove()
        if self.grads:
            self._out_grads(result, {b: live[b] for b in self.reps if b in live})
        self.report = meter.report
        self.owner_of = {sh: rec.site for rec in self.report.sites for sh in rec.shared_with}
        return self.report

    def _out_grads(self, result, outs: dict[str, torch.Tensor]) -> None:
        """dLoss/d(output) of every rep block, by one backward of the profiling forward (the
        upstream gradients ``gradstats`` runs blocks with); parameters' ``.grad`` untouched."""
        loss = loss_of(result)
        if loss is None or not outs:
            return
        gs = torch.autograd.grad(loss, list(outs.values()), allow_unused=True)
        self.out_grads = {b: g for b, g in zip(outs, gs) if g is not None}

    def kind(self, sig: str, members: list[str], reform: bool, per_block: bool) -> KindProfile:
        rep = members[0]
        kp = KindProfile(sig, list(members), [], [], [])
        self.by_ptr: dict[int, int] = {}
        self._storages(kp, rep)
        self._modules(kp, rep)
        for s in kp.storages:
            if s.bytes >= 4096:
                vs = self._views(s, rep) or [(s.name, self.views[f"{rep}|{s.name}"])]
                for c in self.codecs:
                    if not _worth_trying(c, vs, s.lossy_ok, self.device):
                        continue
                    st = codec_stat(c, vs, self.repeats, self.device, self._partner(vs))
                    if st is not None and (s.lossy_ok or st.rel_err == 0.0) and st.bytes < s.bytes:
                        s.codecs[c] = st
        if self.grads:
            t0 = time.perf_counter()
            alone, ckpt = grad_errors(self, kp, rep)
            if alone:
                self.grad_err[sig] = alone
            if ckpt:
                self.grad_ckpt[sig] = ckpt
            self.grad_s += time.perf_counter() - t0
        if reform:
            block = self.modules[rep] if rep else self.model
            for rel in reform_candidates(block, self.device):
                if rel or rep:
                    measure_reform(self, kp, rep, rel)
            if not rep:
                measure_head_reform(self, kp)
        for b in members if per_block else [rep]:
            with torch.no_grad():
                kp.per_block[b] = {
                    str(s.id): row for s in kp.storages if (row := self._row(s, b, rep))
                }
        if self.slopes:
            for s in kp.storages:
                for c, slope in self._slopes(s, rep).items():
                    kp.per_block.setdefault(rep, {}).setdefault(str(s.id), {})[c] = slope
        return kp

    def _partner(self, vs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The save just before a storage's first view by the same op (``<op>#k-1``), if any."""
        prefix, _, k = vs[0][0].rpartition("#")
        name = f"{prefix}#{int(k) - 1}" if k.isdigit() and int(k) > 0 else None
        return [(name, self.views[name])] if name in self.views else []

    def _views(self, s: StorageProfile, block: str) -> list[tuple[str, torch.Tensor]]:
        names = [abs_site(x, block) for x in s.sites if x != "!extern"]
        return [(n, self.views[n]) for n in names if n in self.views]

    @torch.no_grad()
    def _slopes(self, s: StorageProfile, rep: str) -> dict[str, int]:
        """``{"<codec>@slope": P(2n) - P(n)}``: the payload of the storage's first view with its
        rows doubled (stacked along dim 0, memory order kept) minus its own. Payloads are affine
        in rows (per-channel scales, outlier channel lists and PRAC's basis are the intercept),
        so the scaled profile extrapolates them exactly. A layout the stacking changes: none."""
        if not s.codecs:
            return {}
        vs = self._views(s, rep) or [(s.name, self.views[f"{rep}|{s.name}"])]
        name, t = vs[0]
        if t.dim() == 0:
            return {}
        perm = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))  # outermost first
        inner = t.permute(perm).contiguous()
        at = perm.index(0)
        twice = torch.cat([inner, inner], dim=at).permute(
            *sorted(range(t.dim()), key=perm.__getitem__)
        )
        if hidden_channels(twice) != hidden_channels(t):
            return {}
        out = {}
        for c in s.codecs:
            try:
                one = _payload_bytes(run_policy(build_codec(c, t), [(name, t)]))
                two = _payload_bytes(run_policy(build_codec(c, twice), [(name, twice)]))
            except (TypeError, ValueError, RuntimeError, NotImplementedError):
                continue
            out[f"{c}@slope"] = two - one
        return out

    def _row(self, s: StorageProfile, b: str, rep: str) -> dict[str, int]:
        vs = self._views(s, b)
        if not s.sites or not vs:
            return {}
        t = vs[0][1]
        row = {"raw": t.untyped_storage().nbytes()}
        if t.is_floating_point() and t.dim() > 0 and t.numel():
            row["outliers"] = count_outlier_channels(t, channels=hidden_channels(t))
        for c, st in s.codecs.items():
            codec = build_codec(c, t)
            stateful = bool(codec.state_dict())
            own = b == rep or stateful
            row[c] = st.bytes if own else partnered_bytes(codec, vs, self._partner(vs))
        return row

    def _storages(self, kp: KindProfile, rep: str) -> None:
        for rec in self.report.sites:
            if rec.site in self.owner_of or rec.block != rep or rec.bytes == 0:
                continue
            if rec.site not in self.views:
                continue
            same = [rec.site]
            same += [
                x for x in rec.shared_with if sites.block_of(site_module(x), self.blocks) == rep
            ]
            foreign = len(same) != 1 + len(rec.shared_with)  # a saver in another block
            t = self.views[rec.site]
            names = [rel_site(x, rep) for x in same] + (["!extern"] if foreign else [])
            lossy = not self.shapes_only and lossy_allowed(rec.site, t) and not foreign
            sid = len(kp.storages)
            kp.storages.append(
                StorageProfile(sid, names[0], names, rec.bytes, list(rec.shape), rec.dtype, lossy)
            )
            self.by_ptr[sites.storage_key(t)] = sid

    def _modules(self, kp: KindProfile, rep: str) -> None:
        for path, (args, kwargs, _) in list(self.captured.items()):
            if self.region(path) != rep:
                continue
            rel = rel_site(path, rep)
            ins = []
            flat = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            for a in [a for a in flat if sites.storage_key(a) not in self.skip]:
                ptr = sites.storage_key(a)
                if ptr not in self.by_ptr:  # an input nobody saves: stored only if checkpointed
                    sid = self.by_ptr[ptr] = len(kp.storages)
                    nm = f"{rel}:input#{len(ins)}"
                    dt = str(a.dtype).replace("torch.", "")
                    nb = a.untyped_storage().nbytes()
                    lossy = not self.shapes_only and lossy_allowed(f"{rel}:linear#0", a)
                    kp.storages.append(StorageProfile(sid, nm, [], nb, list(a.shape), dt, lossy))
                    self.views[f"{rep}|{nm}"] = a
                ins.append(self.by_ptr[ptr])
            if ins and not self.shapes_only and _extreme_weights(self.modules[path]):
                for sid in ins:  # a recomputation from a lossy copy: the weights amplify its error
                    kp.storages[sid].lossy_ok = False
            internal = [
                s for s in kp.storages
                if s.sites and s.id not in ins and "!extern" not in s.sites
                and all(inside(site_module(x), rel) for x in s.sites)
            ]  # fmt: skip
            if not internal or (not rep and not rel):
                continue
            module = self.modules[path]
            run = partial(call_module, module, args, kwargs)
            t = 0.0 if self.shapes_only else median_time(run, self.repeats, self.device)
            with FlopCounterMode(display=False) as fc:
                call_module(module, args, kwargs)
            flops = int(fc.get_total_flops())
            kp.modules.append(ModuleProfile(rel, type(module).__name__, ins, t, flops))
