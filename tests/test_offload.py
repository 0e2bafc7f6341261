"""The offload action: pinned host buffers reused, copies on side streams ordered by events,
prefetch one block ahead; exact gradients. On CPU the code path runs with the streams stubbed
(``codecs.offload.using_streams``); the ``gpu`` tests run it on CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

import slimact
from slimact import actions
from slimact.codecs.base import get_codec
from slimact.codecs.offload import engine_for, using_streams
from slimact.codecs.saving import CodecPolicy
from slimact.models import build_model


def _models(spec: str):
    torch.manual_seed(0)
    ref = build_model("llama-tiny")
    other = slimact.apply(copy.deepcopy(ref), spec)
    return ref, other


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, targets=ids).loss
    loss.backward()
    return loss.detach()


def test_offload_is_an_action_word():
    assert str(actions.parse("offload+codec:int4-outlier/g32:exact")) == (
        "offload+codec:int4-outlier/g32:exact"
    )
    assert actions.codec("offload+int8") == "offload+codec:int8"
    for bad in ("offload+keep", "offload+", "offload+codec:"):
        with pytest.raises(ValueError, match="unknown action 'offload\\+"):
            actions.parse(bad)
    assert str(actions.parse("offload")) == "offload"
    assert actions.normalize("codec:offload") == "offload"  # older plans' spelling
    assert actions.codec("offload") == "offload"
    assert actions.OFFLOAD in actions.KINDS


def test_offload_codec_labels():
    from slimact.codecs.base import codec_config, codec_label

    cfg = codec_config("offload+int4-outlier/g32")
    assert cfg.inner == "int4-outlier/g32" and codec_label(cfg) == "offload+int4-outlier/g32"
    with pytest.raises(ValueError, match="unknown codec 'int3'"):
        codec_config("offload+int3")
    with pytest.raises(ValueError, match="does not wrap another codec"):
        codec_config("int8+int4")


def test_offload_is_refused_on_cpu():
    with pytest.raises(ValueError, match="in host memory already"):
        slimact.apply(build_model("llama-tiny"), "offload")
    with pytest.raises(ValueError, match="in host memory already"):
        get_codec("offload").encode(torch.randn(4))


def test_offload_under_compile_is_compiled_offload():
    from slimact.registry import compiled_spec

    assert compiled_spec("offload") == "compiled-offload"  # tests/test_compiled_offload.py
    with pytest.raises(ValueError, match="in host memory already"):
        slimact.apply(build_model("llama-tiny"), "offload", compile=True)


def test_offload_exact_gradients_buffers_reused_prefetch_one_block_ahead(fake_streams):
    fake = fake_streams
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with using_streams(fake):
        model, off = _models("offload")  # model: exact autograd (strategy none)
        eng = engine_for(torch.device("cpu"))
        n_blocks = len(slimact.sites.block_paths(off))
        opt_r = torch.optim.SGD(model.parameters(), lr=0.1)
        opt_o = torch.optim.SGD(off.parameters(), lr=0.1)
        allocated = []
        for _ in range(3):
            a, b = _step(model, ids), _step(off, ids)
            assert torch.equal(a, b)
            for (name, p), q in zip(model.named_parameters(), off.parameters()):
                assert torch.equal(p.grad, q.grad), name
            opt_r.step()
            opt_o.step()
            allocated.append(eng.pool.allocated)
            assert eng.pool.in_use_bytes == 0  # every buffer back in the pool after backward
        assert allocated[0] > 0 and allocated[0] == allocated[-1]  # none after the first step
        # every block's input is fetched once per step, all but the last block's ahead of time
        assert eng.fetches == 3 * allocated[0]
        assert eng.prefetches == 3 * (allocated[0] - 1)
        assert allocated[0] >= n_blocks
    _check_ordering(fake.log)


def test_two_forwards_then_two_backwards_prefetch_only_their_own(fake_streams):
    """Gradient accumulation with both graphs alive: each backward prefetches its own
    forward's blocks, never the other forward's; gradients exact."""
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with using_streams(fake_streams):
        ref, off = _models("offload")
        eng = engine_for(torch.device("cpu"))
        for m in (ref, off):
            first, second = m(ids, targets=ids).loss, m(ids.flip(0), targets=ids).loss
            second.backward()
            first.backward()
        assert eng.prefetches == 2 and eng.fetches == 4  # one per backward: block 1 -> block 0
    for (name, p), q in zip(ref.named_parameters(), off.parameters()):
        assert torch.equal(p.grad, q.grad), name


def _check_ordering(log: list) -> None:
    """Device copies start after what they read is written; the device waits for each copy."""
    assert log[0] == ("wait_stream", "d2h", "main")  # after the kernel that made the tensor
    recorded = {id(e[2]): e[1] for e in log if e[0] == "record"}
    for e in log:
        if e[0] == "wait_event":
            src = recorded[id(e[2])]
            assert (e[1], src) in {("h2d", "d2h"), ("main", "h2d"), ("d2h", "h2d")}, e
    # a buffer written again waits for the read of its last tensor (from step 2 on)
    assert any(e[0] == "wait_event" and e[1] == "d2h" for e in log)


def test_offload_meter_counts_host_bytes_apart(fake_streams):
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with using_streams(fake_streams):
        _, rec = _models("recompute")
        _, off = _models("offload")
        with slimact.measure(rec) as mr:
            _step(rec, ids)
        with slimact.measure(off) as mo:
            _step(off, ids)
    held = {s.site: s for s in mo.report.sites if s.op == "checkpoint_input"}
    assert held and {s.action for s in held.values()} == {"offload"}
    ckpt = sum(s.bytes for s in mr.report.sites if s.op == "checkpoint_input")
    assert all(s.bytes == 0 for s in held.values())
    assert mo.report.host_bytes == ckpt  # the block inputs moved, byte for byte
    assert mo.report.total_bytes == mr.report.total_bytes - ckpt
    assert "offloaded to host memory" in mo.report.table()


def _offload_plan():
    from slimact.planner.plan import LayerPlan, Plan

    rows = {"recompute": ("mlp",), "codecs": (("offload", ("mlp:checkpoint_input#0",)),)}
    blocks = tuple(LayerPlan(block=f"layers.{i}", kind="LlamaBlock", **rows) for i in range(2))
    return Plan("llama-tiny", 2, 32, "float32", budget="1GiB", budget_bytes=2**30, layers=blocks)


def test_a_plan_that_offloads_is_refused_on_cpu_and_exact_with_streams(fake_streams):
    plan = _offload_plan()
    with pytest.raises(ValueError, match="in host memory already"):
        slimact.apply(build_model("llama-tiny"), plan)
    assert set(plan.site_actions().values()) >= {"offload", "recompute"}
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with using_streams(fake_streams):
        ref, model = _models(plan)
        with slimact.measure(model) as m:
            assert torch.equal(_step(ref, ids), _step(model, ids))
        for (name, p), q in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(p.grad, q.grad), name
    acts = {s.site: s.action for s in m.report.sites}
    assert acts["layers.0.mlp:checkpoint_input#0"] == "offload" and m.report.host_bytes > 0


# -- on CUDA --------------------------------------------------------------------------------


class SlowCopies:
    """CUDA's streams with every copy delayed: a spin kernel on the copy stream before it (a
    missing wait or ``record_stream`` then shows as a wrong gradient, not as luck)."""

    def __init__(self, cycles: int = 1_000_000) -> None:
        from slimact.codecs.offload import CudaStreams

        self.cuda, self.cycles = CudaStreams(), cycles
        self.pin = True

    def __getattr__(self, name):
        return getattr(self.cuda, name)

    def use(self, stream):
        ctx = self.cuda.use(stream)
        ctx.__enter__()
        torch.cuda._sleep(self.cycles)
        ctx.__exit__(None, None, None)
        return self.cuda.use(stream)


def _cuda_pair(spec, slow_blocks: bool = False):
    torch.manual_seed(0)
    ref = build_model("llama-tiny").cuda()
    model = slimact.apply(copy.deepcopy(ref), spec)
    if slow_blocks:  # the producer of each block input later still, on the main stream
        for path in slimact.sites.block_paths(model):
            block = model.get_submodule(path)
            block.register_forward_pre_hook(lambda m, a: torch.cuda._sleep(4_000_000))
    return ref, model


def _exact_steps(ref, model, steps: int = 3) -> None:
    ids = torch.randint(0, 256, (4, 64), device="cuda", generator=None)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    for _ in range(steps):
        a, b = _step(ref, ids), _step(model, ids)
        assert torch.equal(a, b)
        for (name, p), q in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(p.grad, q.grad), name
        for o in opts:
            o.step()


@pytest.fixture
def math_sdpa():
    """The math attention kernels (deterministic backward), so that two runs compare bit for bit."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


@pytest.mark.gpu
def test_cuda_offload_exact_pinned_buffers_reused(math_sdpa):
    ref, model = _cuda_pair("offload")
    eng = engine_for(torch.device("cuda", torch.cuda.current_device()))
    before = eng.pool.allocated
    _exact_steps(ref, model, steps=1)
    after_first = eng.pool.allocated
    _exact_steps(ref, model, steps=3)
    assert after_first > before and eng.pool.allocated == after_first  # none after step 1
    assert eng.prefetches > 0 and eng.pool.in_use_bytes == 0
    ids = torch.randint(0, 256, (4, 64), device="cuda")
    _, rec = _cuda_pair("recompute")
    with slimact.measure(rec) as mr:
        _step(rec, ids)
    with slimact.measure(model) as mo:
        _step(model, ids)
    ckpt = sum(s.bytes for s in mr.report.sites if s.op == "checkpoint_input")
    assert mo.report.host_bytes == ckpt > 0
    assert mo.report.total_bytes == mr.report.total_bytes - ckpt
    leases = [s for s in mo.report.sites if s.action == "offload"]
    assert leases and all(s.bytes == 0 for s in leases)


@pytest.mark.gpu
def test_cuda_offload_exact_with_delayed_copies(math_sdpa):
    """Stress: every copy starts late on its stream and every block's producer runs late on
    the main stream; only the events keep the data right."""
    with using_streams(SlowCopies()):
        ref, model = _cuda_pair("offload", slow_blocks=True)
        _exact_steps(ref, model, steps=3)
        torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_plan_with_offload_exact(math_sdpa):
    ref, model = _cuda_pair(_offload_plan())
    _exact_steps(ref, model, steps=2)


@pytest.mark.gpu
def test_cuda_link_bandwidth_measured_once():
    from slimact.planner.offload import link_bandwidth

    bw = link_bandwidth("cuda")
    assert 1e8 < bw < 1e12 and link_bandwidth("cuda") == bw  # cached


@pytest.mark.gpu
def test_cuda_auto_with_a_host_budget_runs_exact(math_sdpa):
    """auto with offload and the lossless actions only (recompute, offload, bit-packed masks):
    whatever it chooses on this GPU's link, gradients are exact and the meter's host bytes are
    the plan's."""
    spec = "auto@30%,host_budget=1GiB,codecs=bits,reform=0,repeats=1,cache=none"
    ref, model = _cuda_pair(spec)
    _exact_steps(ref, model, steps=2)
    plan = slimact.planner.apply.runtime_of(model).plan
    ids = torch.randint(0, 256, (4, 64), device="cuda")
    with slimact.measure(model) as m:
        _step(model, ids)
    assert m.report.host_bytes == dict(plan.meta).get("host_bytes", 0)


def _coded_plan(codec: str):
    from slimact.planner.plan import LayerPlan, Plan

    sites = ("mlp.down_proj:linear#0", "self_attn.o_proj:linear#0")
    blocks = tuple(
        LayerPlan(block=f"layers.{i}", kind="LlamaBlock", codecs=((codec, sites),))
        for i in range(2)
    )
    return Plan("llama-tiny", 2, 32, "float32", budget="1GiB", budget_bytes=2**30, layers=blocks)


def test_offload_of_a_coded_tensor_moves_its_payload(fake_streams):
    """``offload+int8``: INT8's payload offloaded; the same gradients as ``int8`` bit for bit
    (checked and deferred encodes), its device bytes in host memory instead."""
    assert _coded_plan("offload+int8").site_actions()["layers.0.mlp.down_proj:linear#0"] == (
        "offload+codec:int8"
    )
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with using_streams(fake_streams):
        _, coded = _models(_coded_plan("int8"))
        _, off = _models(_coded_plan("offload+int8"))
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (coded, off)]
        for step in range(3):  # the first encode of a site is checked, later ones deferred
            with slimact.measure(coded) as mc:
                a = _step(coded, ids)
            with slimact.measure(off) as mo:
                assert torch.equal(a, _step(off, ids))
            for (name, p), q in zip(coded.named_parameters(), off.parameters()):
                assert torch.equal(p.grad, q.grad), (step, name)
            for o in opts:
                o.step()
        eng = engine_for(torch.device("cpu"))
        assert eng.pool.in_use_bytes == 0
    sites_c = {s.site: s for s in mc.report.sites}
    moved = [s for s in mo.report.sites if s.action == "offload+codec:int8"]
    coded_sites = {s.site for s in mc.report.sites if s.action == "codec:int8"}
    assert coded_sites and {s.site for s in moved} == coded_sites
    assert all(s.bytes == 0 for s in moved)
    assert sum(s.host_bytes for s in moved) == sum(sites_c[s.site].bytes for s in moved)
    assert mo.report.total_bytes == mc.report.total_bytes - mo.report.host_bytes


@pytest.mark.gpu
def test_cuda_offload_of_int8_payloads_exact_with_delayed_copies():
    """``offload+int8`` against ``int8`` on CUDA (deferred encodes, no host checks after the
    first step), every copy late on its stream: bit-identical."""
    with using_streams(SlowCopies()):
        ref, model = _cuda_pair(_coded_plan("offload+int8"))
        ref = slimact.apply(ref, _coded_plan("int8"))
        _exact_steps(ref, model, steps=3)


def test_memory_reports_host_bytes_beside_device_bytes():
    from slimact.cli import memory_lines
    from slimact.compiled.advice import documented_dominance

    assert documented_dominance("offload", "cuda") is None  # the codec evidence is not its own
    res = {"device": "cuda:0", "strategy": "offload", "model": "llama-tiny", "params": 1,
           "batch": 2, "seq": 32, "dtype": "float32", "saved_bytes": 10, "baseline_saved_bytes": 40,
           "host_saved_bytes": 2**20, "peak_bytes": 50, "baseline_peak_bytes": 90,
           "step_time_s": 1.0, "baseline_step_time_s": 1.0, "loss": 1.0, "baseline_loss": 1.0,
           "ratio": 0.25, "step_time_ratio": 1.0, "peak_ratio": 0.5, "grad_cosine": 1.0,
           "step_time_ratio_spread": {"min": 1.0, "max": 1.0, "n": 1},
           "timing": {"load_before": 0.0}}  # fmt: skip
    line = next(x for x in memory_lines(res) if x.startswith("saved in host memory"))
    assert "1.00 MiB" in line


def test_an_empty_saved_tensor_is_kept_as_is():
    """``torch.utils.checkpoint`` (torch 2.11) saves a 0-element CPU dummy beside a CUDA block's
    inputs. The policy keeps an empty tensor as is (there is nothing to code), so the offload
    codec, which refuses a tensor already in host memory, never sees it: on an H200 the strategy
    failed on that dummy (torch 2.13 no longer saves it, so a whole step cannot show it here)."""
    policy = CodecPolicy(lambda site, t: get_codec("offload"))
    assert policy("layers.0:checkpoint_input#0", torch.empty(0, requires_grad=True)) is None
    with pytest.raises(ValueError, match="in host memory already"):  # the codec was assigned
        policy("layers.0:checkpoint_input#1", torch.ones(3))
