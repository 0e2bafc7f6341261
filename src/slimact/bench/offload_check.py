"""Offload under ``compile=True``, measured in one device call: what it saves, what it costs.

One model and batch (the GPU check: llama-1b, bf16, 4 x 2048), three points from the same
weights on the same batch:

* ``none``: eager, nothing changed (the gradients' reference);
* ``plan``: ``compiled-auto@<budget>`` without offload;
* ``offload``: the same planner admitting offload (``host_budget``), at ``offload_budget``
  (by default below what the plan without offload can keep: at one budget the planner takes
  the fastest plan, and offload, one forward slower than compile's budget 0 where the link
  hides, is then left out unless the budget needs it).

Both plans are solved from one compiled profile measured once with the offload option in it
(``slimact.planner.compiled``: the profile does not depend on the link), so the two differ only
by what offload adds, and only one profile is compiled. Per point: the *activation peak* (the
step's CUDA peak above what was live before it, minus the parameters' gradient bytes, which a
step allocates whatever its strategy), the step time in interleaved rounds (the ratio of
``offload`` to ``plan``, and the time that did not hide: their medians' difference), the bytes
the meter counts on the device and in host memory, and the minimum over parameters of the
gradient cosine against ``none`` (float64). The host link's bandwidth is the planner's own
measurement (``slimact.planner.offload.link_bandwidth``).

Then the longest sequence each of ``offload``, ``plan``, torch.compile per block at budget 0
(``anchor:compile-block@0``) and ``torch.utils.checkpoint`` trains at batch 1, by doubling from
``seq_start`` until a step runs out of memory (or exceeds ``mem_cap``, a stand-in for a smaller
card that keeps the probes short) or reaches ``seq_cap``; a point's time limit ends its doubling.

``python -m slimact.bench.offload_check --json out.json`` runs it (``--help``: the knobs);
``benchmarks/gpu_check.sh`` runs it on a lent GPU. On a CPU it runs on llama-tiny with the offload
streams stubbed (``codecs.offload.using_streams``), which its test does.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn

import slimact
from slimact.bench.anchors import prepare
from slimact.bench.maxbatch import grad_bytes, parse_cap, peak_at
from slimact.codecs.offload import check_device
from slimact.compiled.blocks import BACKEND_VARIABLE
from slimact.gradcheck import one_minus_cos
from slimact.models import build_model
from slimact.planner.compiled import cached_compiled_profile, solve_compiled
from slimact.planner.offload import OffloadOption, link_bandwidth, parse_host_budget
from slimact.strategies.compiled_auto import CompiledAutoConfig, install_plan
from slimact.timing import interleaved
from slimact.utils import fmt_bytes


@dataclass
class OffloadCheckConfig:
    model: str = "llama-1b"
    batch: int = 4
    seq: int = 2048
    dtype: str = "bfloat16"
    device: str = "cuda"
    vocab_size: int | None = None
    budget: str = "10%"  # compiled-auto's budget without offload
    offload_budget: str | None = "2%"  # with offload (None: the same budget)
    budgets: tuple[float, ...] = (1.0, 0.0)
    codecs: tuple[str, ...] = ("none", "int8")
    host_budget: str = "64GiB"
    link_bw: float | None = None  # None: measured (CUDA)
    rounds: int = 5
    seq_start: int = 4096
    seq_cap: int = 65536
    mem_cap: str | None = None
    maxseq_points: tuple[str, ...] = (
        "offload", "plan", "anchor:compile-block@0", "anchor:torch-checkpoint",
    )  # fmt: skip
    point_limit_s: float = 60.0
    cache: str | None = ""  # the profile cache ('' = ~/.cache/slimact; None or 'none': none)
    root_options: bool = True  # the root's codecs and reformulations among the plans' options
    seed: int = 0


def _loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return m(x, targets=y).loss


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _loss(model, x, x).backward()
    out = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _memory(device: torch.device) -> str:
    """The allocator's live and reserved bytes after a collection (CUDA), for the log: where a
    stage leaves memory held shows before the next one runs out."""
    gc.collect()
    if device.type != "cuda":
        return "host"
    torch.cuda.empty_cache()
    alloc, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    return f"{fmt_bytes(alloc)} allocated, {fmt_bytes(reserved)} reserved"


def _plans(base: nn.Module, x: torch.Tensor, cfg: OffloadCheckConfig, bw: float):
    """Both compiled plans, solved from one profile that has the offload option."""
    root = {} if cfg.root_options else {"root_codecs": (), "root_reform": False}
    prof = cached_compiled_profile(
        copy.deepcopy(base), x, x, cfg.budgets, cfg.codecs, cfg.rounds, cfg.cache, offload=True,
        **root,
    )  # fmt: skip
    off = OffloadOption(bw, parse_host_budget(cfg.host_budget))
    with_off = solve_compiled(prof, cfg.offload_budget or cfg.budget, offload=off)
    return solve_compiled(prof, cfg.budget), with_off, prof


def _install(base: nn.Module, plan: Any, cfg: OffloadCheckConfig) -> nn.Module:
    model = slimact.apply(copy.deepcopy(base), CompiledAutoConfig(budget=cfg.budget))
    install_plan(model, plan)
    return model


def _longest(
    model: nn.Module, forward: Callable, cfg: OffloadCheckConfig, vocab: int, static: int
) -> dict[str, Any]:
    """Doubling at batch 1 (module docstring): the longest sequence that fit, the first that
    did not (None: the cap or the time limit came first)."""
    cap = parse_cap(cfg.mem_cap) if cfg.mem_cap else None
    t0, seq, fits, miss, peaks = time.perf_counter(), cfg.seq_start, None, None, {}
    while seq <= cfg.seq_cap and time.perf_counter() - t0 < cfg.point_limit_s:
        peak = peak_at(model, forward, 1, seq, vocab, cfg.device, cfg.seed)
        peaks[seq] = peak
        if peak is None or (cap is not None and static + peak > cap):
            miss = seq
            break
        fits, seq = seq, 2 * seq
    return {"longest": fits, "first_miss": miss, "peaks": peaks,
            "stopped": "miss" if miss else ("cap" if seq > cfg.seq_cap else "time")}  # fmt: skip


def run(cfg: OffloadCheckConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    t_start = time.perf_counter()
    device = torch.device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(cfg.seed)
    base = build_model(cfg.model, vocab_size=cfg.vocab_size, dtype=dtype,
                       max_seq_len=max(cfg.seq, cfg.seq_cap)).to(device)  # fmt: skip
    vocab = base.config.vocab_size
    gen = torch.Generator().manual_seed(cfg.seed)
    x = torch.randint(0, vocab, (cfg.batch, cfg.seq), generator=gen).to(device)
    bw = cfg.link_bw or link_bandwidth(device)
    check_device(device)  # offload runs on CUDA (or with stubbed streams): refused up front
    log(f"link bandwidth {bw / 1e9:.1f} GB/s; profiling {cfg.model} {cfg.batch}x{cfg.seq}")
    plan, off_plan, prof = _plans(base, x, cfg, bw)
    log(f"plan: {plan.summary()}\noffload: {off_plan.summary()}")
    log(f"memory after the profile: {_memory(device)}")
    models = {
        "none": copy.deepcopy(base),
        "plan": _install(base, plan, cfg),
        "offload": _install(base, off_plan, cfg),
    }
    log(f"memory with the three models: {_memory(device)}")
    ref = _grads(models["none"], x)
    log(f"memory after none's gradients: {_memory(device)}")
    out: dict[str, Any] = {"config": asdict(cfg), "link_bandwidth": bw, "points": {}}
    gbytes = grad_bytes(base)
    for name, m in models.items():
        grads = _grads(m, x)  # (compiles a plan's blocks)
        worst = max(one_minus_cos(g.double(), r.double()) for g, r in zip(grads, ref))
        with slimact.measure(m) as meter:
            loss = _loss(m, x, x)
        loss.backward()
        m.zero_grad(set_to_none=True)
        del loss, grads
        gc.collect()
        peak = peak_at(m, _loss, cfg.batch, cfg.seq, vocab, device, cfg.seed)
        out["points"][name] = {
            "min_grad_cos": 1.0 - worst,
            "device_bytes": meter.report.total_bytes,
            "host_bytes": meter.report.host_bytes,
            "step_peak": peak,
            "activation_peak": None if peak is None else peak - gbytes,
        }
        log(f"{name}: {out['points'][name]}; memory: {_memory(device)}")
    del ref

    def step(m: nn.Module) -> Callable[[], None]:
        def go() -> None:
            m.zero_grad(set_to_none=True)
            _loss(m, x, x).backward()
            _sync(device)

        return go

    timing = interleaved({k: step(m) for k, m in models.items()}, cfg.rounds, warmup=1,
                         alternate=True)  # fmt: skip
    for name in models:
        out["points"][name]["step_s"] = timing.median_s(name)
    ratio = timing.ratio("offload", "plan")
    pts = out["points"]
    out["offload_vs_plan"] = {
        "step_ratio": ratio.median,
        "step_ratio_spread": [ratio.min, ratio.max],
        "activation_peak_ratio": _ratio(
            pts["offload"]["activation_peak"], pts["plan"]["activation_peak"]
        ),  # fmt: skip
        "time_not_hidden_s": pts["offload"]["step_s"] - pts["plan"]["step_s"],
        "bytes_offloaded": pts["offload"]["host_bytes"],
    }
    steps = ", ".join(f"{k} {pts[k]['step_s'] * 1e3:.1f} ms" for k in models)
    log(f"steps: {steps}; offload / plan {ratio.median:.3f} [{ratio.min:.3f}-{ratio.max:.3f}]")
    out["plans"] = {"plan": plan.summary(), "offload": off_plan.summary()}
    for m in models.values():
        m.zero_grad(set_to_none=True)
    models.pop("none")
    gc.collect()
    static = sum(p.numel() * p.element_size() for p in base.parameters())
    out["longest_seq"] = {}
    for point in cfg.maxseq_points:
        if point in models:
            m, fwd = models[point], _loss
        else:
            backend = os.environ.get(BACKEND_VARIABLE) or "inductor"  # (tests: a fast one)
            prep = prepare(point.removeprefix("anchor:"), copy.deepcopy(base), _loss, device,
                           backend=backend)  # fmt: skip
            m, fwd = prep.model, prep.forward
        res = _longest(m, fwd, cfg, vocab, static)
        out["longest_seq"][point] = res
        log(f"longest at batch 1, {point}: {res['longest']} ({res['stopped']})")
        models.pop(point, None)
        del m
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ls = out["longest_seq"]
    if "offload" in ls and "plan" in ls:
        out["offload_vs_plan"]["longest_seq_ratio"] = _ratio(ls["offload"]["longest"],
                                                             ls["plan"]["longest"])  # fmt: skip
    out["wall_s"] = time.perf_counter() - t_start
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def table(out: dict[str, Any]) -> str:
    """The result as markdown: the three points, then the longest sequences."""
    c = out["config"]
    lines = [
        f"offload under compile=True: {c['model']} {c['dtype']} {c['batch']} x {c['seq']}, "
        f"compiled-auto@{c['budget']} (with offload: @{c['offload_budget'] or c['budget']}, "
        f"host_budget={c['host_budget']}), link {out['link_bandwidth'] / 1e9:.1f} GB/s",
        "",
        "| point | activation peak | device bytes | host bytes | step s | min grad cos |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, p in out["points"].items():
        ap = p["activation_peak"]
        lines.append(
            f"| {name} | {fmt_bytes(ap) if ap is not None else 'OOM'} | "
            f"{fmt_bytes(p['device_bytes'])} | {fmt_bytes(p['host_bytes'])} | "
            f"{p['step_s']:.4f} | {p['min_grad_cos']:.6f} |"
        )
    r = out["offload_vs_plan"]
    f = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    lines += [
        "",
        f"offload vs plan: activation peak {f(r['activation_peak_ratio'], '.3f')}x, step "
        f"{f(r['step_ratio'], '.3f')}x (rounds {f(r['step_ratio_spread'][0], '.3f')}-"
        f"{f(r['step_ratio_spread'][1], '.3f')}), time not hidden "
        f"{1e3 * r['time_not_hidden_s']:.1f} ms, offloaded {fmt_bytes(r['bytes_offloaded'])}",
        "",
        "| longest seq at batch 1 | longest | first miss | stopped by |",
        "| --- | --- | --- | --- |",
    ]
    for name, s in out["longest_seq"].items():
        lines.append(f"| {name} | {s['longest']} | {s['first_miss']} | {s['stopped']} |")
    if "longest_seq_ratio" in r:
        lines.append(f"\nlongest sequence, offload / plan: {f(r['longest_seq_ratio'], '.2f')}x")
    return "\n".join(lines)


def _tuple(kind: type) -> Callable[[str], tuple]:
    return lambda s: tuple(kind(v) for v in s.split("/") if v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slimact.bench.offload_check",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    d = OffloadCheckConfig()
    for name, value in asdict(d).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, tuple):
            kind = float if name == "budgets" else str
            p.add_argument(flag, type=_tuple(kind), default=value, help="'/'-separated")
        elif isinstance(value, bool):
            p.add_argument(flag, type=lambda v: v.lower() in ("1", "true", "yes"), default=value)
        elif value is None:
            conv = float if name == "link_bw" else (int if name == "vocab_size" else str)
            p.add_argument(flag, type=conv, default=value)
        else:
            p.add_argument(flag, type=type(value), default=value)
    p.add_argument("--json", default=None, help="write the result JSON here ('-': stdout)")
    args = vars(p.parse_args(argv))
    if isinstance(args["cache"], str) and args["cache"].lower() == "none":
        args["cache"] = None  # no profile cache (as compiled-auto's ``cache=none``)
    path = args.pop("json")
    out = run(OffloadCheckConfig(**args))
    text = table(out)
    print(text)
    if path == "-":  # one line on stdout, after the table
        print(json.dumps(out, default=str))
    elif path:
        with open(path, "w") as fh:
            json.dump({**out, "table": text}, fh, indent=1, default=str)
    return 0


__all__ = ["OffloadCheckConfig", "main", "run", "table"]

if __name__ == "__main__":
    raise SystemExit(main())
