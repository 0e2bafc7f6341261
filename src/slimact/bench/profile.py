"""``slimact bench SUITE --profile POINTS``: where one eager training step's time goes, per point.

A step-time ratio says *that* a point is slow; this says *why*, in one short run. For the
suite's first model case (its model, batch, dtype and device), every point (``none`` first,
always) is prepared from one copy of the case's model, warmed up, and a few warm steps
(forward + backward, as the bench times them) run under ``torch.profiler`` (CPU activity, and
CUDA activity on a GPU). Per step it reports:

* ``step_ms``: the median over interleaved rounds of all the points, profiler off (and its ratio
  to ``none``'s; a point is started only with time left for these rounds within the suite's
  time budget); ``profiled_ms``: the host's wall time of a profiled step;
* ``kernels`` (device kernels run), ``launches`` (kernel-launch calls of the CUDA runtime and
  driver) and ``device_ms`` (the kernels' summed time; far below ``step_ms``, the device waits
  for the host: launch overhead or syncs), on CUDA;
* ``aten_ops``: ``aten::`` ops dispatched (nested ones too); ``outside_ops``: the top-level
  ones outside compiled graphs, and ``graphs``: compiled forward + backward graph calls
  (``compiled.outside``: all of a step's ops are outside for an eager point); ``launch_count``:
  the launch count of ``slimact.bench.launches`` (``tests/test_launches.py``'s measure) as the
  profiler sees it: the outermost ``aten::`` ops, views and uninitialized allocations excluded,
  plus the driver's ``cuLaunchKernel`` calls (Triton's launches; PyTorch's go through the
  runtime API);
* ``syncs``: the host waits for the device: on CUDA the runtime's ``cudaStreamSynchronize`` /
  ``cudaDeviceSynchronize`` / ``cudaEventSynchronize`` / blocking ``cudaMemcpy`` calls; on a CPU,
  which has no queue, the ops that would sync there (``aten::_local_scalar_dense``: ``.item()``,
  ``bool(t)``; ``aten::nonzero``...). ``sync_events`` breaks them down by name, with the
  device-to-pageable copies;
* the top ops by self device time (kernels, by name) and by self CPU time (host events).

Only events inside a step count (each step is one ``record_function`` range; the device is
synchronized between steps, outside them). A point written ``compiled-refs:<strategy>`` runs
``<strategy>`` with ``ops.compiled_ref``'s CUDA switch on (the codecs' statistics compiled by
inductor instead of eager kernel chains), the A/B for that switch in one run. The JSON is
rewritten after every point (a run cut short keeps what it measured), and :func:`markdown`
renders it as one table plus each point's top ops.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from slimact.bench import anchors
from slimact.bench.case_data import Data, build, loss_fn
from slimact.bench.cases import BenchPoint, Suite
from slimact.bench.deadline import Deadline, PointTimeout, time_limit
from slimact.bench.launches import ALLOC_OPS, VIEW_OPS
from slimact.compare import train_step_fn
from slimact.compiled.outside import outside_figures
from slimact.data import load_data
from slimact.envinfo import machine_info
from slimact.ops import compiled_ref
from slimact.strategies import apply
from slimact.timing import interleaved
from slimact.utils import seed_everything

COMPILED_REFS = "compiled-refs:"
STEP_RANGE = "slimact::profile_step"
SCHEMA = 1
Log = Callable[[str], None]

_SYNC_CALLS = {
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
}
# ops that read a device value on the host or size their output by the data (tests/test_syncs.py)
_HOST_READS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique2",
}
UNCOUNTED = VIEW_OPS | ALLOC_OPS
_LAUNCH_PREFIXES = ("cudaLaunch", "cuLaunch", "cudaGraphLaunch")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def point_spec(point: str) -> tuple[str, bool]:
    """(the point as the bench knows it, whether the compiled refs run on CUDA)."""
    if point.startswith(COMPILED_REFS):
        return point[len(COMPILED_REFS) :], True
    return point, False


def profile_points(points: list[str]) -> list[str]:
    """``points`` with ``none`` first and no repeats, each checked (an unknown name is a
    ValueError listing the valid ones; ``compiled-refs:`` takes a strategy, not an anchor)."""
    out = list(dict.fromkeys(["none", *(p.strip() for p in points if p.strip())]))
    for p in out:
        spec, refs = point_spec(p)
        if refs and BenchPoint(spec).is_anchor:
            raise ValueError(f"{p!r}: {COMPILED_REFS!r} takes a strategy, not an anchor")
        BenchPoint(spec)
    return out


def _counted_op(e) -> bool:
    """Does ``e`` count in ``launch_count``: an ``aten::`` op, not a view or an uninitialized
    allocation, and not inside another ``aten::`` op (the dispatcher's own decomposition)?"""
    if not e.name.startswith("aten::") or e.name in UNCOUNTED:
        return False
    parent = getattr(e, "cpu_parent", None)
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = getattr(parent, "cpu_parent", None)
    return True


def _self_device_us(e) -> float:
    return e.time_range.elapsed_us()


def step_figures(events, top: int = 12) -> dict[str, Any]:
    """Per-step figures of a profile's events (the module docstring's list), from the events
    inside the ``STEP_RANGE`` ranges (device events: all of them; nothing else runs kernels)."""
    ranges = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.name == STEP_RANGE and e.device_type == DeviceType.CPU
    )
    n = len(ranges)
    if not n:
        raise ValueError(f"no {STEP_RANGE!r} range among the profile's events")

    def inside(e) -> bool:
        t = e.time_range.start
        return any(a <= t <= b for a, b in ranges)

    host = [e for e in events if e.device_type == DeviceType.CPU and inside(e)]
    # device events: kernels, copies, and the ranges of record_function spans on the device
    device = [
        e
        for e in events
        if e.device_type == DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and e.name != STEP_RANGE
    ]
    kernels = [e for e in device if not e.name.startswith(("Memcpy", "Memset"))]
    names = Counter(e.name for e in host)
    cuda = bool(device) or any(k.startswith("cuda") for k in names)
    sync = {k: names[k] for k in sorted(_SYNC_CALLS | _HOST_READS | {"aten::item"}) if names[k]}
    pageable = sum("DtoH" in e.name and "Pageable" in e.name for e in device)
    if pageable:
        sync["Memcpy DtoH (Device -> Pageable)"] = pageable
    counted = _SYNC_CALLS if cuda else _HOST_READS
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_kernel[e.name][0] += 1
        by_kernel[e.name][1] += _self_device_us(e)
    by_host: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in host:
        by_host[e.name][0] += 1
        by_host[e.name][1] += e.self_cpu_time_total

    def top_of(table: dict[str, list[float]]) -> list[dict]:
        rows = sorted(table.items(), key=lambda kv: -kv[1][1])[:top]
        return [
            {"name": k[:120], "count": c / n, "ms": us / n / 1e3} for k, (c, us) in rows if us > 0
        ]

    outside = outside_figures(events, STEP_RANGE)
    return {
        "steps": n,
        "profiled_ms": statistics.median((b - a) / 1e3 for a, b in ranges),
        "aten_ops": sum(v for k, v in names.items() if k.startswith("aten::")) / n,
        "outside_ops": outside.eager_ops,
        "graphs": outside.graphs,
        "launch_count": (
            sum(_counted_op(e) for e in host) + names["cuLaunchKernel"] + names["cuLaunchKernelEx"]
        )
        / n,
        "kernels": len(kernels) / n if cuda else None,
        "launches": (
            sum(v for k, v in names.items() if k.startswith(_LAUNCH_PREFIXES)) / n if cuda else None
        ),
        "device_ms": sum(_self_device_us(e) for e in kernels) / n / 1e3 if cuda else None,
        "syncs": sum(names[k] for k in counted) / n,
        "sync_events": {k: v / n for k, v in sync.items()},
        "top_device": top_of(by_kernel),
        "top_cpu": top_of(by_host),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_step(step: Callable[[], None], device: torch.device, steps: int, top: int) -> dict:
    """:func:`step_figures` of ``steps`` calls of ``step`` (one more first, discarded: the
    profiler's own start-up), the device synchronized around each."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(
        activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1)
    ) as p:
        for _ in range(steps + 1):
            _sync(device)
            with record_function(STEP_RANGE):
                step()
            _sync(device)
            p.step()
    return step_figures(p.events(), top)


def _refs(on_cuda: bool):
    return compiled_ref.compiled_refs_on_cuda() if on_cuda else nullcontext()


def _with_refs(step: Callable[[], None], on_cuda: bool) -> Callable[[], None]:
    if not on_cuda:
        return step

    def run() -> None:
        with compiled_ref.compiled_refs_on_cuda():
            step()

    return run


def profile_suite(
    suite: Suite,
    points: list[str],
    out: str | Path | None = None,
    *,
    warmup: int = 2,
    steps: int = 2,
    rounds: int = 3,
    top: int = 12,
    point_timeout_s: float | None = 120.0,
    data: str | None = None,
    log: Log = print,
    command: str | None = None,
) -> dict:
    """Profile ``points`` on ``suite``'s first case (module docstring); write the result JSON to
    ``out`` after every point (None: not written) and return it."""
    points = profile_points(points)
    case = suite.cases[0]
    device = torch.device(suite.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"suite {suite.name!r} needs CUDA, but no GPU is visible")
    deadline = Deadline(suite.time_budget_s)
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "meta": {
            **machine_info(),
            **({"command": command} if command else {}),
            "suite": suite.name,
            "case": case.label,
            "model": case.model,
            "batch": case.batch,
            "seq": case.seq,
            "device": suite.device,
            "dtype": suite.dtype,
            "bf16_autocast": suite.bf16,
            "warmup": warmup,
            "profiled_steps": steps,
            "rounds": rounds,
            "time_budget_s": suite.time_budget_s,
            "wall_s": None,
            "complete": False,
        },
        "points": [],
    }

    def save() -> None:
        result["meta"]["wall_s"] = time.perf_counter() - t0
        if out is not None:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(result, indent=1) + "\n")

    splits = load_data(data) if case.vocab_size is None else None
    batch = Data(case, splits, suite.seed, device).batch
    source = build(case.model, device, suite.seed, case.vocab_size).to(_DTYPES[suite.dtype])
    ac = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if suite.bf16 else nullcontext
    live: dict[str, Callable[[], None]] = {}
    log(f"slimact bench {suite.name} --profile: {', '.join(points)} on {case.label}, "
        f"{case.batch} x {case.seq}, {suite.dtype} on {suite.device} -> {out}")  # fmt: skip
    for name in points:
        spec, on_cuda = point_spec(name)
        rec: dict[str, Any] = {"point": name, "strategy": spec, "compiled_refs": on_cuda}
        result["points"].append(rec)
        t_point = time.perf_counter()
        try:
            # the timing rounds of the points profiled so far stay within the budget
            reserve = 1.0 + 1.5 * rounds * sum(
                r["profiled_ms"] / 1e3 for r in result["points"] if r["point"] in live
            )
            limit = deadline.limit(point_timeout_s, reserve)
            with time_limit(limit, name), _refs(on_cuda):
                model = copy.deepcopy(source)
                bp = BenchPoint(spec)
                if bp.is_anchor:
                    forward = anchors.prepare(
                        bp.anchor, model, loss_fn, device, suite.compile_budget,
                        suite.compile_backend,
                    ).forward  # fmt: skip
                else:
                    apply(model, spec)
                    forward = loss_fn

                def fwd(m, x, y, forward=forward):
                    with ac():
                        return forward(m, x, y)

                seed_everything(suite.seed)
                step = train_step_fn(model, *batch, fwd)
                for _ in range(warmup):
                    step()
                _sync(device)
                rec.update(profile_step(step, device, steps, top))
                live[name] = _with_refs(step, on_cuda)
        except (KeyboardInterrupt, SystemExit):
            raise
        except PointTimeout as e:
            rec["skipped"] = f"timed out: {e}"
        except Exception as e:
            rec["skipped"] = f"{type(e).__name__}: {e}".strip()[:500]
            rec["traceback_tail"] = traceback.format_exc().strip().splitlines()[-3:]
        rec["wall_s"] = time.perf_counter() - t_point
        log(f"  {name:<28} " + (f"skipped: {rec['skipped'][:150]}" if "skipped" in rec else
            f"profiled {rec['profiled_ms']:.1f} ms, {rec['aten_ops']:.0f} aten ops, "
            f"syncs {rec['syncs']:g} ({rec['wall_s']:.1f} s)"))  # fmt: skip
        save()
    if len(live) > 1 and "none" in live:
        try:
            with time_limit(deadline.limit(None), "timing rounds"):
                timing = interleaved(live, rounds=rounds, warmup=0, alternate=True)
            for rec in result["points"]:
                if rec["point"] in live:
                    rec["step_ms"] = timing.median_s(rec["point"]) * 1e3
                    rec["step_ratio"] = timing.ratio(rec["point"], "none").median
        except PointTimeout as e:
            result["meta"]["timing_skipped"] = f"timed out: {e}"
    result["meta"]["complete"] = all("skipped" not in r for r in result["points"])
    save()
    return result


def _num(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(result: dict, top: int = 12) -> str:
    """The profile as markdown: one row per point, then each point's top ops."""
    m = result["meta"]
    lines = [
        f"### Step profile: {m['case']}, {m['batch']} x {m['seq']}, {m['dtype']} on "
        f"{m['device']} ({m.get('gpu', m.get('processor', ''))}, torch {m['torch']})",
        "",
        "Per warm eager step (forward + backward): step ms by interleaved rounds, profiler off; "
        "the rest from profiled steps.",
        "",
        "| point | step ms | / none | profiled ms | device ms | kernels | launches | aten ops "
        "| outside graphs | graphs | launch count | syncs | sync events |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in result["points"]:
        if "skipped" in r:
            lines.append(
                f"| `{r['point']}` | | | | | | | | | | | | not run: {r['skipped'][:100]} |"
            )
            continue
        events = ", ".join(f"{k} {v:g}" for k, v in r["sync_events"].items()) or "-"
        lines.append(
            f"| `{r['point']}` | {_num(r.get('step_ms'), '.1f')} | "
            f"{_num(r.get('step_ratio'), '.2f')} | {r['profiled_ms']:.1f} | "
            f"{_num(r['device_ms'], '.1f')} | {_num(r['kernels'], '.0f')} | "
            f"{_num(r['launches'], '.0f')} | {r['aten_ops']:.0f} | "
            f"{_num(r.get('outside_ops'), '.0f')} | {_num(r.get('graphs'), 'g')} | "
            f"{_num(r.get('launch_count'), '.0f')} | {r['syncs']:g} | {events} |"
        )
    for r in result["points"]:
        if "skipped" in r:
            continue
        for key, what in (("top_device", "self device time"), ("top_cpu", "self CPU time")):
            rows = r[key][:top]
            if not rows:
                continue
            lines += ["", f"`{r['point']}`, top by {what} (per step):", ""]
            lines += [f"- {x['ms']:.2f} ms, {x['count']:g}x `{x['name'][:90]}`" for x in rows]
    return "\n".join(lines) + "\n"
