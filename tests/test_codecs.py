"""Codec interface and registry, bit-packed masks, CPU offload, and saving through a codec."""

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import slimact
from slimact import sites
from slimact.codecs import CodecPolicy, codec_config, codec_label, get_codec
from slimact.codecs.base import _CODECS, Codec, Packed, codec_names
from slimact.codecs.bits import pack_bits, unpack_bits
from slimact.codecs.build import build_codec
from slimact.meter import measure
from slimact.models import build_model
from slimact.planner.apply import install_policy


def test_registry_names_and_errors():
    for name in ("int4", "int4-asym", "int8", "int4-channel", "int4-outlier", "bits", "offload"):
        assert (name in codec_names()) == (name != "offload")  # offload: the planner's own option
        codec = get_codec(name)
        assert isinstance(codec, Codec) and codec.metadata()["codec"] == name
    with pytest.raises(ValueError, match="unknown codec 'int3'.*int4"):
        get_codec("int3")
    meta = get_codec("int4-outlier").metadata()
    assert meta["threshold"] == 3.0 and meta["bits"] == 4 and meta["group_size"] == 128


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001])
@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.float32, torch.bfloat16])
def test_bits_roundtrip_exact_and_one_bit_per_value(n, dtype):
    x = (torch.rand(n) > 0.3).to(dtype)
    codec = get_codec("bits")
    p = codec.encode(x)
    assert codec.nbytes(p) == (n + 7) // 8 + (0 if dtype == torch.bool else x.element_size())
    y = codec.decode(p)
    assert y.dtype == dtype and torch.equal(y, x)


def test_bits_layout_and_rejection():
    x = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)
    assert pack_bits(x).tolist() == [0b10000001, 0b00000001]
    assert torch.equal(unpack_bits(pack_bits(x), 9), x)
    mask = torch.rand(5, 3) > 0.5
    assert torch.equal(get_codec("bits").decode(get_codec("bits").encode(mask.t())), mask.t())
    noise = torch.tensor([0.0, 1 / 0.9, 0.0, 1 / 0.9])  # CPU dropout's saved noise
    p = get_codec("bits").encode(noise)
    assert torch.equal(get_codec("bits").decode(p), noise) and get_codec("bits").nbytes(p) == 1 + 4
    with pytest.raises(ValueError, match="holds other values"):
        get_codec("bits").encode(torch.tensor([0.0, 0.5, 1.0]))
    with pytest.raises(ValueError, match="holds other values"):
        get_codec("bits").encode(torch.tensor([0, 3, 5], dtype=torch.uint8))


def test_offload_refuses_a_cpu_tensor():
    with pytest.raises(ValueError, match="in host memory already"):
        get_codec("offload").encode(torch.randn(4, 6))


@pytest.mark.gpu
def test_offload_cuda_pinned_side_stream():
    codec = get_codec("offload")
    x = torch.randn(1024, 1024, device="cuda").t()
    p = codec.encode(x)
    (host,) = codec.host_tensors(p)
    assert host.is_pinned() and codec.nbytes(p) == 0 and codec.host_nbytes(p) == x.numel() * 4
    assert torch.equal(codec.decode(p), x)


class CountingCodec(Codec):
    """Lossless codec that counts encodes/decodes (a stand-in for a real one)."""

    def __init__(self):
        super().__init__(get_codec("offload").config)
        self.encodes = self.decodes = 0

    def encode(self, x):
        self.encodes += 1
        y = x.clone(memory_format=torch.contiguous_format)
        return Packed({"host": y}, tuple(x.shape), x.dtype, x.device)

    def decode(self, packed):
        self.decodes += 1
        return packed.tensors["host"]


class QKV(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return (self.q(x) * self.k(x)).sum(-1, keepdim=True) * self.v(x)


def test_shared_input_encoded_once_decoded_once_and_parameters_skipped():
    torch.manual_seed(0)
    model = QKV()
    codec = CountingCodec()
    seen = []

    def assign(site, t):
        seen.append(t)
        return codec if site.endswith(":linear#0") else None

    install_policy(model, CodecPolicy(assign))
    x = torch.randn(3, 5, 16, requires_grad=True)
    out = model(x)
    assert codec.encodes == 1  # q, k and v all save x: one payload
    assert not any(isinstance(t, nn.Parameter) for t in seen)
    out.sum().backward()
    assert codec.decodes == 1  # decoded once, shared by the three backward nodes
    ref = QKV()
    ref.load_state_dict(model.state_dict())
    x2 = x.detach().clone().requires_grad_()
    ref(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_views_of_one_storage_share_a_payload_with_their_own_strides():
    """Like SDPA's output and o_proj's reshaped input: two dense views of one storage."""

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.o = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            b, s, _ = x.shape
            h = self.a(x)
            p = h.view(b, s, 4, 8).transpose(1, 2)  # [B, H, S, Dh] view of h's storage
            return self.o(h) + torch.sin(p).transpose(1, 2).reshape(b, s, 32)

    codec = CountingCodec()
    model = Heads()
    install_policy(model, CodecPolicy(lambda site, t: codec))
    x = torch.randn(2, 6, 32, requires_grad=True)
    with measure(model) as m:
        out = model(x)
    assert codec.encodes == 2  # x (a's input) and h; sin's permuted view reuses h's payload
    by_site = {r.site: r for r in m.report.sites}
    assert ":sin#0" in by_site["o:linear#0"].shared_with and by_site[":sin#0"].bytes == 0
    out.square().sum().backward()
    ref = Heads()
    ref.load_state_dict(model.state_dict())
    x2 = x.detach().clone().requires_grad_()
    ref(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_raw_storage_is_not_encoded_for_a_later_view():
    model = QKV()
    codec = CountingCodec()
    calls = []

    def assign(site, t):
        calls.append(site)
        if site.endswith("q:linear#0"):
            return None
        return codec if "linear" in site else None

    install_policy(model, CodecPolicy(assign))
    model(torch.randn(2, 16)).sum().backward()
    assert codec.encodes == 0  # k and v save the same x that q kept: nothing to gain
    assert "q:linear#0" in calls and "k:linear#0" not in calls


def test_encode_errors_name_the_site():
    model = QKV()
    install_policy(model, CodecPolicy(lambda site, t: get_codec("bits")))
    with pytest.raises(ValueError, match=r"site q:linear#0: codec 'bits'"):
        model(torch.randn(2, 16))


def test_codec_policy_composes_with_recompute():
    torch.manual_seed(0)
    x = torch.randint(0, 100, (2, 32))

    def run(strategy):
        torch.manual_seed(0)
        m = build_model("llama-tiny")
        if strategy:
            slimact.apply(m, strategy)
        with measure(m) as meter:
            loss = m(x, targets=x).loss
        loss.backward()
        return (
            meter.report.total_bytes,
            loss.item(),
            torch.cat([p.grad.flatten() for p in m.parameters()]),
        )

    b_rec, l_rec, g_rec = run("recompute")
    b_both, l_both, g_both = run("recompute+int4")
    b_int4, _, _ = run("int4")
    assert l_both == pytest.approx(l_rec)
    assert b_both < b_rec and b_int4 < run(None)[0]
    assert float(F.cosine_similarity(g_rec, g_both, dim=0)) > 0.99


def test_router_nesting_policy_is_innermost_for_site_names():
    model = QKV()
    names = []
    install_policy(model, CodecPolicy(lambda site, t: names.append(site)))
    with sites.tracking(model):
        model(torch.randn(2, 16))
    assert names[0] == "q:linear#0"


# ----------------------------------------------------------------------------- labels


def test_every_registered_codec_label_round_trips():
    names = list(_CODECS)  # ``import slimact`` registered every codec (PRAC's included)
    assert "prac" in names
    assert {"int4-token", "int8-token"} <= set(names)  # baselines: labels name them...
    assert not {"int4-token", "int8-token"} & set(codec_names())  # ...the planner does not
    for name in names:
        cfg = codec_config(name)
        assert codec_label(cfg) == name and codec_config(codec_label(cfg)) == cfg


@pytest.mark.parametrize(
    "label, fields",
    [
        ("int4-outlier/g32", {"group_size": 32}),
        ("int4-asym/g16", {"group_size": 16, "symmetric": False}),
        ("int4-outlier/g16,threshold=2.5,paper_scale=True", {"threshold": 2.5}),
        ("int4-channel/paper_scale=True", {"paper_scale": True}),
        ("int4/b8,g64", {"bits": 8, "group_size": 64}),
        ("prac/r1=0.5", {"r1": 0.5}),
        ("prac/r1=12,r2=0.1,k_scale=2.0", {"r1": 12, "r2": 0.1, "k_scale": 2.0}),
        ("int4-token/paper_scale=False", {"paper_scale": False}),
    ],
)
def test_parametrized_labels_round_trip(label, fields):
    cfg = codec_config(label)
    for k, v in fields.items():
        got = getattr(cfg, k)
        assert got == v and type(got) is type(v), (k, got)  # r1=12 stays an int (a rank)
    back = codec_config(codec_label(cfg))
    assert back == cfg
    # the labeled form of any config with its unlabeled fields at their defaults reads back
    wider = dataclasses.replace(cfg, **({"group_size": 8} if hasattr(cfg, "group_size") else {}))
    assert codec_config(codec_label(wider)) == wider


def test_bad_labels_say_why():
    with pytest.raises(ValueError, match="unknown codec 'int3'"):
        codec_config("int3/g16")
    with pytest.raises(ValueError, match="'foo=1' is not a field of OutlierConfig"):
        codec_config("int4-outlier/foo=1")
    with pytest.raises(ValueError, match="twice"):
        codec_config("int4/g16,group_size=32")
    with pytest.raises(ValueError, match="threshold='x' is not a"):
        codec_config("int4-outlier/threshold=x")
    with pytest.raises(ValueError, match="group_size"):  # the config's own validation
        codec_config("int4/g1")


def test_build_codec_takes_labels_and_sizes_channels():
    t = torch.randn(2, 8, 4, 16).transpose(1, 2)  # [B, H, S, Dh] view of [B, S, H, Dh]
    codec = build_codec("int4-channel/paper_scale=True", t)
    assert codec.config.channels == 64 and codec.config.paper_scale  # H * Dh
    assert build_codec("int4-outlier/g32", t, channels=0).config.channels == 0
    assert build_codec("int4-asym/g16", t).config.group_size == 16
    assert get_codec("int4-outlier/g32").config.group_size == 32
