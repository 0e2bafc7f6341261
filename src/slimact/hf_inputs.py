"""What a Hugging Face model's forward takes, and a tiny valid batch of it, by structure.

``model.dummy_inputs`` of a ``transformers`` model is ``{"input_ids": ...}`` for nearly every
class, vision and audio models included, so a strategy probing a ViT or Whisper with it crashes
inside the model. :func:`dummy_inputs` builds the input the forward really takes, read from
``model.main_input_name`` and the config: token ids (HF's own ``dummy_inputs``), ``pixel_values``
(``num_channels`` x ``image_size``), Whisper-style ``input_features`` (``num_mel_bins`` x
``2 * max_source_positions``) and raw-audio ``input_values`` (long enough for the conv feature
encoder), plus ``decoder_input_ids`` for encoder-decoder models. :func:`refuse_unless_token_ids`
is the one-line refusal of strategies that can only drive a model with token ids (``auto``).
:func:`lm_loss` calls the loss of slimact's models and HF causal / masked LMs alike,
:func:`mlm_batch` masks a batch BERT-style, :func:`random_token_batch` draws a planning batch
(``slimact.hf`` re-exports the first two). :func:`hf_model_of` is the model slimact acts on for
a wrapped one (a peft ``PeftModel``, DDP, a ``.module`` wrapper): ask it, not the wrapper, what
the model is (its class, config, loss head, label shifting).

Layer 2 (see ARCHITECTURE.md): torch only, so ``reformulate`` and the strategies can use it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from slimact.state import model_of
from slimact.utils import model_device

TOKEN_INPUT = "input_ids"


def hf_model_of(model: nn.Module) -> nn.Module:
    """The model slimact acts on for ``model``: ``model`` itself, or the model a wrapper wraps,
    every wrapper peeled off (``state.model_of``, the one rule ``apply``, ``applied`` and
    ``revert`` follow): a peft ``PeftModel``'s ``get_base_model()`` (the HF model, with the
    LoRA layers injected in it), a peft tuner's ``model``, the ``module`` of DDP /
    ``DataParallel`` / any ``.module`` wrapper (a prompt-learning ``PeftModel`` is no wrapper:
    its forward prepends virtual tokens). A ``PeftModelForCausalLM`` looks like an HF
    causal LM but is none (no ``PreTrainedModel``, a forward without ``use_cache``): code that
    reads what a model is (``is_hf_model``, its config, its head, how it shifts labels) reads
    it off ``hf_model_of(model)``."""
    return model_of(model)


def is_hf_model(model: nn.Module) -> bool:
    """A ``transformers.PreTrainedModel`` (checked without importing transformers)."""
    return any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__)


def main_input(model: nn.Module) -> str:
    """The name of the forward's main input (``input_ids``, ``pixel_values``, ...)."""
    return str(getattr(model, "main_input_name", TOKEN_INPUT) or TOKEN_INPUT)


def is_encoder_decoder(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def _float_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _pair(v: Any) -> tuple[int, int] | None:
    if isinstance(v, int):
        return v, v
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, int) for x in v):
        return int(v[0]), int(v[1])
    return None


def _audio_length(cfg: Any, frames: int = 16) -> int | None:
    """Samples a conv feature encoder turns into ``frames`` frames (None: no conv stack)."""
    kernels, strides = getattr(cfg, "conv_kernel", None), getattr(cfg, "conv_stride", None)
    if not kernels or not strides or len(kernels) != len(strides):
        return None
    n = frames
    for k, s in zip(reversed(kernels), reversed(strides)):
        n = (n - 1) * int(s) + int(k)
    return n


def _main_tensor(model: nn.Module, name: str) -> torch.Tensor | None:
    cfg = getattr(model, "config", None)
    dtype = _float_dtype(model)
    gen = torch.Generator().manual_seed(0)
    if name == "pixel_values":
        hw = _pair(getattr(cfg, "image_size", None))
        if hw is None:
            return None
        channels = int(getattr(cfg, "num_channels", 3) or 3)
        return torch.randn(1, channels, *hw, generator=gen, dtype=dtype)
    if name == "input_features":  # Whisper: (batch, mel bins, 2 * max_source_positions)
        mels, src = getattr(cfg, "num_mel_bins", None), getattr(cfg, "max_source_positions", None)
        if not isinstance(mels, int) or not isinstance(src, int):
            return None
        return torch.randn(1, mels, 2 * src, generator=gen, dtype=dtype)
    if name == "input_values":  # raw audio (wav2vec2, HuBERT, WavLM)
        n = _audio_length(cfg)
        return None if n is None else torch.randn(1, n, generator=gen, dtype=dtype)
    return None


def dummy_inputs(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """Keyword inputs for one tiny forward of a HF ``model`` on its own device, or None where
    its main input is one this module does not know how to make."""
    name = main_input(model)
    if name == TOKEN_INPUT:
        dummy = getattr(model, "dummy_inputs", None)
        if not isinstance(dummy, dict) or not isinstance(dummy.get(TOKEN_INPUT), torch.Tensor):
            return None
        out = dict(dummy)
    else:
        main = _main_tensor(model, name)
        if main is None:
            return None
        out = {name: main}
        if is_encoder_decoder(model):
            start = getattr(model.config, "decoder_start_token_id", None)
            out["decoder_input_ids"] = torch.full((1, 4), int(start or 0), dtype=torch.long)
    dev = model_device(model)
    return {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def refuse_unless_token_ids(model: nn.Module, strategy: str, why: str) -> None:
    """Raise one clear ``ValueError`` line unless ``model`` is driven by token ids alone: its
    main input is ``input_ids`` and it is not an encoder-decoder model (whose forward needs
    decoder inputs too). ``why``: what in ``strategy`` needs the token ids."""
    if not is_hf_model(model):
        return
    name, enc_dec = main_input(model), is_encoder_decoder(model)
    if name == TOKEN_INPUT and not enc_dec:
        return
    takes = f"takes {name!r}" + (" and decoder inputs (encoder-decoder)" if enc_dec else "")
    raise ValueError(
        f"strategy {strategy!r} does not support {type(model).__name__}: {why}, and its forward "
        f"{takes}; supported: decoder-only and encoder-only models whose forward takes "
        f"input_ids (on this model use recompute, int4, int8, prac or invact)"
    )


def lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The training loss of one batch, for slimact models and HF causal / masked LMs.

    slimact models: ``model(input_ids, targets=labels)`` (labels already shifted). HF models:
    ``model(input_ids=..., labels=...)``; causal LMs shift ``labels`` themselves (pass
    ``input_ids``), masked LMs score the positions whose label is not -100.
    """
    if is_hf_model(model):
        out = model(input_ids=input_ids, labels=labels)
    else:
        out = model(input_ids, targets=labels)
    if getattr(out, "loss", None) is None:
        raise ValueError(
            f"{type(model).__name__} returned no loss; is it a *ForCausalLM/*ForMaskedLM?"
        )
    return out.loss


def mlm_batch(
    input_ids: torch.Tensor, mask_token_id: int, prob: float = 0.15, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT-style masking: ``prob`` of positions replaced by ``mask_token_id``; labels -100 else."""
    if not 0 < prob < 1:
        raise ValueError(f"prob must be in (0, 1), got {prob}")
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.rand(input_ids.shape, generator=gen) < prob
    chosen[..., 0] |= ~chosen.any(-1)  # at least one scored position per row
    chosen = chosen.to(input_ids.device)
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
    return torch.where(chosen, torch.full_like(input_ids, mask_token_id), input_ids), labels


def random_token_batch(
    model: nn.Module, batch: int, seq: int, seed: int, who: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, next-token targets) of ``batch`` x ``seq`` random tokens from ``seed``, on the
    model's device: what a planner given a batch shape (not a batch) profiles on."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int):
        raise ValueError(f"{who}(batch, seq) needs model.config.vocab_size to draw tokens")
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(model_device(model))
    return t[:, :-1], t[:, 1:]


__all__ = [
    "dummy_inputs",
    "hf_model_of",
    "is_encoder_decoder",
    "is_hf_model",
    "lm_loss",
    "main_input",
    "mlm_batch",
    "random_token_batch",
    "refuse_unless_token_ids",
]
