"""slimact strategies on many Hugging Face architectures: text, vision, audio (issue 14.9).

Eighteen small random-weight models (offline, built from configs): decoders (Llama, Qwen2,
Mistral, Gemma, Phi, GPT-2, GPT-NeoX), encoders (BERT, RoBERTa), encoder-decoders (T5, BART,
Whisper), vision encoders (ViT, DeiT, Swin, CLIP vision, SigLIP vision) and raw-audio Wav2Vec2.
Each strategy is checked against exact autograd (the unpatched model) on the same batch and
dropout masks: ``recompute`` and ``invact`` give the same gradients to fp32 rounding; ``int4``
keeps the cosine of the flattened gradient >= 0.98 (and of every parameter >= 0.9); ``prac``
(unbiased but noisy) stays finite and aligned; stored bytes, measured with ``slimact.measure``,
drop below the baseline's. Where a strategy cannot drive an architecture it refuses with one
line naming the class (``auto``: token-id models only) or records why it skipped
(``chunked-ce`` without an LM head), never computing different gradients.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import slimact
from slimact import hf
from slimact.hf_inputs import dummy_inputs, main_input

transformers = pytest.importorskip("transformers")
t = transformers
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only contend

V, B, S = 128, 2, 16
DEC = dict(
    vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S,
)  # fmt: skip
ENC = dict(
    vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4,
)  # fmt: skip
VIT = dict(
    image_size=16, patch_size=4, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4,
)  # fmt: skip
SEQ2SEQ = dict(
    vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
)  # fmt: skip


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ids(seq: int = S, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V - 1, (B, seq), generator=_gen(seed))


def _image() -> torch.Tensor:
    return torch.randn(B, 3, 16, 16, generator=_gen(1))


def _lm(model):
    return model, {"input_ids": _ids(), "labels": _ids()}


def _classes(model, **inputs):
    return model, {**inputs, "labels": torch.tensor([0, 2])}


BUILDERS = {
    # text decoders
    "llama": lambda: _lm(t.LlamaForCausalLM(t.LlamaConfig(**DEC))),
    "qwen2": lambda: _lm(t.Qwen2ForCausalLM(t.Qwen2Config(**DEC))),
    "mistral": lambda: _lm(t.MistralForCausalLM(t.MistralConfig(**DEC))),
    "gemma": lambda: _lm(t.GemmaForCausalLM(t.GemmaConfig(**DEC, head_dim=16))),
    "phi": lambda: _lm(t.PhiForCausalLM(t.PhiConfig(**DEC))),
    "gpt2": lambda: _lm(
        t.GPT2LMHeadModel(
            t.GPT2Config(
                vocab_size=V,
                n_embd=64,
                n_layer=2,
                n_head=4,
                n_positions=S,
                bos_token_id=V - 1,
                eos_token_id=V - 1,
            )  # fmt: skip
        )
    ),
    "gpt_neox": lambda: _lm(
        t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**ENC, max_position_embeddings=S))
    ),
    # text encoders
    "bert": lambda: _lm(t.BertForMaskedLM(t.BertConfig(**ENC, max_position_embeddings=S))),
    "roberta": lambda: _classes(
        t.RobertaForSequenceClassification(
            t.RobertaConfig(**ENC, max_position_embeddings=S + 2, num_labels=3)
        ),
        input_ids=_ids(),
    ),
    # encoder-decoders (text, and audio: Whisper reads log-mel input_features)
    "t5": lambda: (
        t.T5ForConditionalGeneration(
            t.T5Config(
                vocab_size=V,
                d_model=64,
                d_kv=16,
                d_ff=128,
                num_layers=2,
                num_heads=4,
                decoder_start_token_id=0,
            )  # fmt: skip
        ),
        {"input_ids": _ids(), "labels": _ids(8, seed=2)},
    ),
    "bart": lambda: (
        t.BartForConditionalGeneration(t.BartConfig(**SEQ2SEQ, max_position_embeddings=S)),
        {"input_ids": _ids(), "labels": _ids(8, seed=2)},
    ),
    "whisper": lambda: (
        t.WhisperForConditionalGeneration(
            t.WhisperConfig(
                **SEQ2SEQ,
                num_mel_bins=16,
                max_source_positions=8,
                max_target_positions=S,
                decoder_start_token_id=V - 1,
                pad_token_id=V - 1,
            )  # fmt: skip
        ),
        {"input_features": torch.randn(B, 16, 16, generator=_gen(1)), "labels": _ids(8, 2)},
    ),
    # vision
    "vit": lambda: _classes(
        t.ViTForImageClassification(t.ViTConfig(**VIT, num_labels=3)), pixel_values=_image()
    ),
    "deit": lambda: _classes(
        t.DeiTForImageClassification(t.DeiTConfig(**VIT, num_labels=3)), pixel_values=_image()
    ),
    "swin": lambda: _classes(
        t.SwinForImageClassification(
            t.SwinConfig(
                image_size=16,
                patch_size=2,
                embed_dim=16,
                depths=[2, 2],
                num_heads=[2, 4],
                window_size=4,
                num_labels=3,
            )  # fmt: skip
        ),
        pixel_values=_image(),
    ),
    "clip_vision": lambda: (
        t.CLIPVisionModel(t.CLIPVisionConfig(**VIT)),
        {"pixel_values": _image()},
    ),
    "siglip_vision": lambda: (
        t.SiglipVisionModel(t.SiglipVisionConfig(**VIT)),
        {"pixel_values": _image()},
    ),
    # raw audio
    "wav2vec2": lambda: _classes(
        t.Wav2Vec2ForSequenceClassification(
            t.Wav2Vec2Config(
                **ENC,
                conv_dim=(16, 16),
                conv_stride=(5, 2),
                conv_kernel=(10, 3),
                num_conv_pos_embeddings=16,
                num_conv_pos_embedding_groups=4,
                mask_time_prob=0.0,
                layerdrop=0.0,
                num_labels=3,
            )  # fmt: skip
        ),
        input_values=torch.randn(B, 400, generator=_gen(1)),
    ),
}
ARCHS = tuple(BUILDERS)
MAIN_INPUT = {a: "input_ids" for a in ARCHS} | {
    "whisper": "input_features", "wav2vec2": "input_values", "vit": "pixel_values",
    "deit": "pixel_values", "swin": "pixel_values", "clip_vision": "pixel_values",
    "siglip_vision": "pixel_values",
}  # fmt: skip
TOKEN_ONLY = ("llama", "qwen2", "mistral", "gemma", "phi", "gpt2", "gpt_neox", "bert", "roberta")
NOT_TOKEN_ONLY = tuple(a for a in ARCHS if a not in TOKEN_ONLY)
NOTHING_TO_INVERT = ("t5",)  # ReLU, and every norm feeds a dropout: no saved output to reuse
# the default run: twelve architectures, text / vision / audio; the rest run with -m slow
# (Llama, Qwen2, Mistral, GPT-2 and BERT are also in tests/test_hf.py)
FAST = (
    "gemma", "phi", "gpt2", "gpt_neox", "roberta", "bart",
    "vit", "deit", "swin", "clip_vision", "whisper", "wav2vec2",
)  # fmt: skip


def arch_params(archs=ARCHS):
    return [a if a in FAST else pytest.param(a, marks=pytest.mark.slow) for a in archs]


def build(arch: str, strategy: str | None = None):
    torch.manual_seed(0)
    model, inputs = BUILDERS[arch]()
    model.train()
    if strategy is not None:
        slimact.apply(model, strategy)
    return model, inputs


def loss_of(out) -> torch.Tensor:
    if getattr(out, "loss", None) is not None:
        return out.loss
    return out.last_hidden_state.float().pow(2).mean()  # bare encoders (CLIP / SigLIP vision)


def step(model, inputs) -> tuple[int, float]:
    """One forward + backward on fixed dropout masks; (stored bytes, loss)."""
    torch.manual_seed(3)
    with slimact.measure(model) as meter:
        loss = loss_of(model(**inputs))
    loss.backward()
    return int(meter.report.total_bytes), float(loss.detach())


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@functools.cache
def baseline(arch: str) -> tuple[int, float, dict[str, torch.Tensor]]:
    model, inputs = build(arch)
    nbytes, loss = step(model, inputs)
    return nbytes, loss, grads(model)


def flat_cosine(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    assert ref.keys() == got.keys()
    a = torch.cat([ref[n].float().flatten() for n in ref])
    b = torch.cat([got[n].float().flatten() for n in ref])
    return float(F.cosine_similarity(a, b, dim=0))


def min_param_cosine(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    cos = [
        float(F.cosine_similarity(ref[n].flatten(), got[n].flatten(), dim=0))
        for n in ref
        if ref[n].norm() > 1e-6 * max(1.0, float(got[n].norm()))
    ]
    return min(cos)


def run(arch: str, strategy: str):
    """(bytes ratio vs none, loss, baseline loss, baseline grads, grads) of one step."""
    base_bytes, base_loss, base_grads = baseline(arch)
    model, inputs = build(arch, strategy)
    nbytes, loss = step(model, inputs)
    return nbytes / base_bytes, loss, base_loss, base_grads, grads(model), model


def test_at_least_twelve_architectures_across_modalities():
    assert len(FAST) >= 12 and set(FAST) <= set(ARCHS)
    assert {MAIN_INPUT[a] for a in FAST} == {
        "input_ids", "pixel_values", "input_features", "input_values"
    }  # fmt: skip


@pytest.mark.parametrize("arch", arch_params())
def test_recompute_is_exact_and_stores_less(arch):
    ratio, loss, base_loss, ref, got, _ = run(arch, "recompute")
    assert loss == base_loss
    assert ref.keys() == got.keys()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-7, msg=n)
    assert ratio < 0.35, ratio  # measured 0.09 (Swin) .. 0.27 (SigLIP)


@pytest.mark.parametrize("arch", arch_params())
def test_int4_gradients_stay_close_and_store_less(arch):
    ratio, loss, base_loss, ref, got, _ = run(arch, "int4")
    assert loss == pytest.approx(base_loss, rel=1e-6)  # codecs act on backward only
    assert all(torch.isfinite(g).all() for g in got.values())
    # T5 attends eagerly (relative position bias), so int4 also stores its attention
    # probabilities: flattened 0.979, its layer norms 0.92; every other model >= 0.985
    assert flat_cosine(ref, got) >= (0.97 if arch == "t5" else 0.98)
    assert min_param_cosine(ref, got) >= 0.9
    assert ratio < 0.55, ratio  # measured 0.27 (BART) .. 0.51 (CLIP vision; q, k exact)


@pytest.mark.parametrize(
    "arch", arch_params(("vit", "whisper", "wav2vec2", *(a for a in ARCHS if a not in FAST)))
)
def test_invact_is_exact_and_never_stores_more(arch):
    ratio, loss, base_loss, ref, got, model = run(arch, "invact")
    assert loss == pytest.approx(base_loss, rel=1e-6)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-3, atol=1e-5, msg=n)
    if arch in NOTHING_TO_INVERT:
        assert ratio == 1.0
        assert hf.skipped(model)  # and it says why, per module
    else:  # the probe ran on the model's real input (pixel_values, input_features, ...)
        assert ratio < 0.95, ratio  # measured 0.48 (Phi) .. 0.93 (Wav2Vec2)
        assert not any("unverified" in why for _, _, why in hf.skipped(model))


@pytest.mark.parametrize("arch", arch_params(("swin", "wav2vec2", "whisper", "vit", "t5")))
def test_prac_runs_on_any_input(arch):
    # Swin, Whisper and Wav2Vec2 save transposed views: PRAC compressed them along the wrong dim
    ratio, loss, base_loss, ref, got, _ = run(arch, "prac")
    assert loss == pytest.approx(base_loss, rel=1e-6)
    assert all(torch.isfinite(g).all() for g in got.values())
    assert flat_cosine(ref, got) > 0.3  # unbiased but noisy (measured 0.80 .. 0.99)
    # Whisper at 8 frames: every site's basis would outweigh its payload, so PRAC keeps them
    assert ratio <= 1.0 if arch == "whisper" else ratio < 1.0, ratio


@pytest.mark.parametrize("arch", NOT_TOKEN_ONLY)
def test_auto_refuses_what_it_cannot_plan_in_one_line(arch):
    model, _ = build(arch)
    name = type(model).__name__
    with pytest.raises(ValueError, match=f"does not support {name}") as err:
        slimact.apply(model, "auto@25%")
    msg = str(err.value)
    assert "\n" not in msg and "supported: decoder-only and encoder-only" in msg
    assert repr(main_input(model)) in msg
    assert hf.patched_modules(model) == [] and not slimact.applied(model)


@pytest.mark.parametrize(
    "arch",
    [
        "gpt_neox",
        "vit",
        *(pytest.param(a, marks=pytest.mark.slow) for a in ARCHS if a not in ("gpt_neox", "vit")),
    ],
)
def test_chunked_ce_applies_or_says_why(arch):
    ratio, loss, base_loss, ref, got, model = run(arch, "chunked-ce")
    changes = slimact.applied(model)
    assert changes
    if all(c.skipped for c in changes):  # not a causal LM head: nothing changed, and why
        assert all(c.detail for c in changes)
        assert loss == base_loss and ratio == 1.0
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=0, atol=0, msg=n)
    else:
        assert arch in TOKEN_ONLY
        assert loss == pytest.approx(base_loss, rel=1e-5)
        assert flat_cosine(ref, got) > 0.9999
        assert ratio <= 1.0


def test_chunked_ce_skips_a_masked_lm():
    # BertForMaskedLM has labels and a Linear decoder, but its labels are not shifted: chunked-ce
    # (HF's causal loss) computed a different loss, and its probe let it pass at random init
    model, inputs = build("bert", "chunked-ce")
    (change,) = slimact.applied(model)
    assert change.skipped and "ForMaskedLM" in change.detail
    assert "forward" not in model.__dict__


@pytest.mark.parametrize("arch", ARCHS)
def test_dummy_inputs_drive_the_model(arch):
    model, inputs = build(arch)
    assert main_input(model) == MAIN_INPUT[arch]
    dummy = dummy_inputs(model)
    assert dummy is not None and MAIN_INPUT[arch] in dummy
    model.eval()
    with torch.no_grad():
        out = model(**dummy)
    assert out is not None


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("arch", ["gemma", "gpt_neox"])
def test_auto_plans_more_decoders(arch):
    ratio, loss, base_loss, ref, got, _ = run(arch, "auto@50%")
    assert loss == pytest.approx(base_loss, rel=1e-5)
    assert flat_cosine(ref, got) > 0.9
    assert ratio < 0.6, ratio  # budget 50%: measured 0.52 (Gemma), 0.54 (GPT-NeoX)
