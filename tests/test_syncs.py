"""No device-to-host syncs in an action's per-step path.

On a GPU, an op that reads a device tensor on the host (``.item()``, ``bool(t)``, ``.tolist()``)
or whose output shape depends on the data (``nonzero``, boolean indexing, ``unique``...) makes
the host wait until the device has run everything queued before it. A CPU has no such queue, so
these tests count the ops that *would* sync: a ``TorchDispatchMode`` sees every aten op of a
training step (forward, backward, optimizer step; compiled graphs run as their compiled code,
``ignore_compile_internals``) and a ``TorchFunctionMode`` the host reads that never reach the
dispatcher (``Tensor.tolist``, ``Tensor.numpy``). One step after warm-up steps, under each
strategy, must count exactly what the same step counts under ``none`` (AdamW's step counters and
the model's own token-id check, which ``none`` has too).

One host read is not a sync and is not counted: ``slimact.ops.deferred`` reading the host copy
of a verdict batch, which on a GPU it does only after the copy's event has completed (never
waiting); on a CPU that copy is the tensor itself.
"""

from __future__ import annotations

import collections
import sys
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import slimact
from slimact.codecs.offload import using_streams
from slimact.models import build_model
from slimact.ops import compiled_ref
from slimact.planner.evolve import PlanEvolver
from slimact.planner.replan import is_tracking_step

aten = torch.ops.aten

# ops that read a device value on the host, or whose output size depends on the data
_SYNC_OPS = {
    aten._local_scalar_dense,  # .item(), bool(t), int(t), float(t)
    aten.is_nonzero,
    aten.equal,
    aten.nonzero,
    aten.argwhere,
    aten.masked_select,
    aten.masked_scatter,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.unique_dim_consecutive,
    aten.bincount,
}
# on CUDA these check the solver's convergence on the host (linalg's error check)
_CHECKED_LINALG = {aten._linalg_svd, aten._linalg_eigh, aten.linalg_cholesky_ex}
_HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy}
_DEFERRED = "slimact/ops/deferred.py"


def _has_bool_index(indices) -> bool:
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


def _cross_device_copy(func, args, kwargs) -> bool:
    """A blocking copy between devices (device-to-host, or host-to-device without
    ``non_blocking``: PyTorch synchronizes the stream after it)."""
    if func is aten._to_copy.default:
        src, dev = args[0], kwargs.get("device")
        return (
            dev is not None and torch.device(dev) != src.device and not kwargs.get("non_blocking")
        )
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return dst.device != src.device and blocking
    return False


class SyncCounter(TorchDispatchMode):
    """Counts sync-forcing aten ops (name -> count), with where they came from."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.where: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # a compiled graph runs as compiled code (and is not re-traced under us)

    def record(self, name: str) -> None:
        self.counts[name] += 1
        frames, f = [], sys._getframe(2)
        while f is not None and len(frames) < 3:
            if "/slimact/" in f.f_code.co_filename:
                frames.append(f"{f.f_code.co_filename.rsplit('/slimact/', 1)[1]}:{f.f_lineno}")
            f = f.f_back
        self.where[name][" < ".join(frames) or "(outside slimact)"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pk = func.overloadpacket
        if pk in _SYNC_OPS:
            self.record(str(pk))
        elif pk in _CHECKED_LINALG:
            self.record(f"{pk} (CUDA error check)")
        elif pk in (aten.index, aten.index_put, aten.index_put_) and _has_bool_index(args[1]):
            self.record(f"{pk} (bool mask)")
        elif pk is aten.repeat_interleave and kwargs.get("output_size") is None:
            self.record(str(pk))
        elif _cross_device_copy(func, args, kwargs):
            self.record(f"{func} (across devices)")
        return func(*args, **kwargs)


class HostReadCounter(TorchFunctionMode):
    """Counts ``tolist``/``numpy`` reads, which no dispatch mode sees (but those of
    ``slimact.ops.deferred``, see the module docstring)."""

    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            caller = sys._getframe(1)  # the first frame past torch and other modes
            while caller is not None and (
                "/torch/" in caller.f_code.co_filename
                or caller.f_code.co_name == "__torch_function__"
            ):
                caller = caller.f_back
            if not _deferred_poll(caller):
                self.counter.record(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


def _deferred_poll(frame) -> bool:
    """Is ``frame`` ``slimact.ops.deferred`` reading a finished copy for ``poll`` (which never
    waits)? Its ``wait`` does wait: those reads count."""
    if frame is None or not frame.f_code.co_filename.endswith(_DEFERRED):
        return False
    while frame is not None and frame.f_code.co_filename.endswith(_DEFERRED):
        if frame.f_code.co_name == "wait":
            return False
        frame = frame.f_back
    return True


def _step(model, opt, ids) -> None:
    out = model(ids, targets=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def count_syncs(
    spec,
    *,
    compile: bool = False,
    warmup: int = 2,
    steps: int = 1,
    evolve: bool = False,
    shape: tuple[int, int] = (2, 64),
    layers: int = 2,
) -> SyncCounter:
    """The sync-forcing ops of ``steps`` training steps of llama-tiny (``shape`` tokens, ``layers``
    blocks) under ``spec`` after ``warmup`` steps (``evolve``: with a ``PlanEvolver`` told of every step, as
    ``slimact train`` runs it). The CPU refs run eagerly in the counted steps
    (``compiled_ref.eager_refs``: the same ops, which dynamo would not compile under a dispatch
    mode anyway); ``compile=True`` blocks run compiled."""
    torch.manual_seed(0)
    model = build_model("llama-tiny", n_layers=layers)
    if spec != "none":
        slimact.apply(model, spec, compile=compile)
    evolver = PlanEvolver(model) if evolve else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(1))

    def step(i: int) -> None:
        _step(model, opt, ids)
        if evolver is not None:
            evolver.on_step(i)

    for i in range(1, warmup + 1):
        step(i)
    counter = SyncCounter()
    with compiled_ref.eager_refs(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with counter, HostReadCounter(counter):
            for i in range(warmup + 1, warmup + steps + 1):
                step(i)
    return counter


_BASELINE: dict[tuple, SyncCounter] = {}


def baseline(steps: int = 1, shape: tuple[int, int] = (2, 64), layers: int = 2) -> SyncCounter:
    if (steps, shape, layers) not in _BASELINE:
        _BASELINE[steps, shape, layers] = count_syncs(
            "none", steps=steps, shape=shape, layers=layers
        )
    return _BASELINE[steps, shape, layers]


def extra(
    counter: SyncCounter, steps: int = 1, shape: tuple[int, int] = (2, 64), layers: int = 2
) -> dict[str, int]:
    """Ops the strategy adds over ``none`` (with where they came from, for the message)."""
    more = counter.counts - baseline(steps, shape, layers).counts
    return {f"{k} at {dict(counter.where[k])}": v for k, v in more.items()}


def test_none_counts_only_the_optimizer_and_the_models_own_check():
    c = baseline()
    assert set(c.counts) == {"aten._local_scalar_dense"}
    assert sum(c.counts.values()) == 22  # AdamW's 21 step counters + the token-id check


# auto: planned on the first training forward, fast to profile (one repeat, no cache)
AUTO = "auto@25%,repeats=1,cache=None"


@pytest.mark.parametrize(
    "spec",
    ["int4", "int8", "prac", "invact", "chunked-ce", AUTO, "invact+int4+chunked-ce"],
)
def test_no_extra_syncs_per_step(spec):
    assert extra(count_syncs(spec)) == {}


def test_int4_no_extra_syncs_where_sdpa_saves_a_large_logsumexp():
    """At 2 x 64 tokens SDPA's saved logsumexp (batch x heads x tokens: 512 values) is below the
    int4 rules' ``min_numel`` and no rule looks at it; at 4 x 128 (2,048) the rules ask its role,
    and reading whether a tensor SDPA saves without grad is a 0/1 mask was a sync per layer and
    step (``classify.role_of``: a logsumexp is never one, and is not read)."""
    assert extra(count_syncs("int4", shape=(4, 128)), shape=(4, 128)) == {}


def test_offload_no_extra_syncs_per_step(fake_streams):
    """Offload's copies and prefetches are ordered by events only (its streams stubbed on CPU:
    ``codecs.offload.using_streams``)."""
    with using_streams(fake_streams):
        assert extra(count_syncs("offload")) == {}


@pytest.mark.slow  # profiles, then six steps with three tracking steps: ~20 s on 2 cores
def test_plan_runtime_codecs_and_the_evolver_between_tracking_steps():
    """A plan of codecs alone (the plan runtime's table, one codec per storage), with the
    evolver attached. Tracking steps (1, 2, 4, 8, ...) read on the host (outlier counts, trial
    encodes of every candidate codec, timed), and a re-plan there gives the changed storages new
    codecs, whose sites are checked on the host at their first save, in the next step: not
    part of this test's bar. Step 6 follows neither, so it adds nothing."""
    cap = PlanEvolver.default_config.cap
    assert not is_tracking_step(5, cap) and not is_tracking_step(6, cap)
    spec = "auto@40%,codecs=int8/int4-outlier,recompute=False,reform=False,repeats=1,cache=None"
    assert extra(count_syncs(spec, evolve=True, warmup=5)) == {}


def test_prac_subspace_update_steps():
    """Q1 is re-fit every ``t1`` steps; with ``t1=1`` every counted step re-fits it. Its SVD is
    the one op left: on CUDA ``torch.linalg.svd`` checks its convergence on the host."""
    got = extra(count_syncs("prac@t1=1", steps=2), steps=2)
    assert got and all(k.startswith("aten._linalg_svd (CUDA error check)") for k in got), got


def test_compiled_auto_no_extra_syncs_per_step():
    """``compile=True auto@10%``: compiled blocks with traced codecs, the eager root through the
    plan runtime (chunked loss head, inverted final norm, or INT8). One block: the profile
    compiles each option on a kind's first and last block, which one block halves; a sync per
    block would still be one per step."""
    spec = "auto@10%,codecs=none/int8,budgets=1/0,rounds=1,cache=None"
    assert extra(count_syncs(spec, compile=True, layers=1), layers=1) == {}


# --- what the deferred checks still guarantee ---------------------------------------------------


def _rows(scale_row: float = 1.0) -> torch.Tensor:
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    x[5] *= scale_row
    return x


def test_a_late_problem_is_reported_and_the_site_is_checked_on_the_host_again():
    from slimact.codecs.base import exact_value, get_codec
    from slimact.codecs.saving import CodecPolicy

    codec = get_codec("int4")
    policy = CodecPolicy(lambda site, t: codec)
    policy.reset()
    assert policy("m:linear#0", _rows()).fallback is None  # checked on the host: clean
    policy.end()
    policy.reset()
    wide = _rows(1e3)  # beyond max_range: the host check would store it exactly
    stored = policy("m:linear#0", wide)
    assert stored.fallback is None  # deferred: coded, within the codec's bound
    y = stored.unpack()
    bound = wide.abs().view(-1, 128).amax(1).repeat_interleave(128).view_as(wide) / 7 / 2
    assert bool(((y - wide).abs() <= bound * (1 + 1e-6)).all())
    policy.end()
    with pytest.warns(RuntimeWarning, match=r"site m:linear#0: a row's norm.*after its step"):
        policy.reset()
    assert sum(policy.late["m:linear#0"].values()) == 1
    again = policy("m:linear#0", wide.clone())  # checked on the host again: the row exactly
    assert again.fallback is None and again.packed.meta["n_rows"] == 1
    assert torch.equal(again.unpack()[5], wide[5])
    whole = torch.logspace(-2, 1.05, 64)[:, None] * torch.randn(32)  # a spread bulk: whole
    policy.end()
    policy.reset()
    assert "dynamic range" in policy("m:linear#1", whole).fallback
    assert exact_value(policy("m:linear#1", whole.clone()).packed) is not None


def test_deferred_encodes_keep_nan_and_inf_exactly():
    from slimact.codecs.base import get_codec

    for name in ("int4", "int4-asym", "int8", "int8-channel", "int4-outlier"):
        codec = get_codec(name)
        x = _rows()
        x[2, 3], x[5, 0], x[9, 7] = float("nan"), float("inf"), -float("inf")
        d = codec.encode_deferred(x, {"capacity": 0})
        y = codec.decode(d.packed)
        assert torch.isnan(y[2, 3]) and y[5, 0] == float("inf") and y[9, 7] == -float("inf")
        finite = torch.isfinite(x)
        assert bool(torch.isfinite(y[finite]).all()), name


def test_outlier_capacity_follows_the_count():
    from slimact.codecs.base import get_codec

    codec = get_codec("int4-outlier")
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(1))
    x[:, [5, 30]] *= 40.0
    state: dict = {}
    codec.calibrate(codec.encode(x), state)
    assert state["capacity"] == 2
    d = codec.encode_deferred(x, state)  # the same two channels, found on the device
    assert d.packed.tensors["outlier_idx"].tolist() == [5, 30]
    assert torch.equal(codec.decode(d.packed)[:, [5, 30]], x[:, [5, 30]])
    x[:, 11] *= 40.0  # a third: quantized with the rest this time, the capacity grows
    d = codec.encode_deferred(x, state)
    flat = torch.cat([v.reshape(-1) for v in d.verdict]).tolist()
    assert d.explain(flat) is None and state["capacity"] == 3


def test_prac_keeps_its_basis_when_a_deferred_update_meets_nan():
    from slimact.codecs.prac import PracCodec, PracCodecConfig

    codec = PracCodec(PracCodecConfig(r1=4, r2=4, t1=1, t2=1), name="s")
    x = torch.randn(128, 32, generator=torch.Generator().manual_seed(0))
    codec.encode(x)
    q1 = codec.q1.clone()
    bad = x.clone()
    bad[3, 4] = float("nan")
    d = codec.encode_deferred(bad, {})
    assert torch.equal(codec.q1, q1)  # the update was not taken (decided on the device)
    y = codec.decode(d.packed)
    assert bool(torch.isnan(y[3]).all()) and bool(torch.isfinite(y[torch.arange(128) != 3]).all())
    flat = torch.cat([v.reshape(-1).double() for v in d.verdict]).tolist()
    assert "non-finite" in d.explain(flat) and codec.q1_pending  # retried at the next encode


def test_a_norm_weight_that_stops_being_invertible_gives_nan_never_garbage():
    from slimact.modules.inv_act import InvRMSNorm

    m = InvRMSNorm(16)
    x = torch.randn(3, 16, requires_grad=True)
    m(x).sum().backward()  # checked on the host: invertible
    with torch.no_grad():
        m.weight[3] = 0.0  # a new version: checked on the device, read at the next call
    x.grad = None
    m(x).sum().backward()
    assert bool(torch.isnan(x.grad).any())  # y / w lost x̂ there: NaN, not a wrong value
    assert m.fallbacks == 0
    x.grad = None
    m(x).sum().backward()  # the verdict is read: saves x from now on, exact gradients
    assert m.fallbacks == 1 and "min |weight|" in m.inv.reason
    assert bool(torch.isfinite(x.grad).all())
