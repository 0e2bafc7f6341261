"""CoLA model sizes (cola.txt Table 5, App. D) and the full-rank "control" of Table 7.

``cola-60m`` ... ``cola-1b`` are the LLaMA sizes of ``slimact.models.registry`` with r/d = 128/512,
256/768, 256/1024, 512/2048 (Table 5: 43M, 94M, 185M, 609M parameters with the papers' 32000-token
vocabulary); ``cola-7b`` uses r = d/4 = 1024 (App. D's default). ``cola-tiny`` (tests) and
``cola-20m`` (the CPU default: llama-20m with r = d/4 = 128) use the byte vocabulary. "Both σ"
(App. E.1) is on for d <= 768 (60M/130M and our small models) and off above, as in the paper.

``llama-20m-control`` is Table 7's "control": a full-rank LLaMA scaled down (4 layers of width 384,
d_ff 1152, instead of 6 of 512) to about cola-20m's training FLOPs and parameters (``slimact flops``
computes both), to show whether CoLA's
quality comes from the architecture or just from being a smaller model.
"""

from __future__ import annotations

from slimact.cola.model import CoLAConfig, CoLALlamaModel, default_both_sigma
from slimact.models.llama import LlamaConfig, LlamaModel
from slimact.models.registry import BYTE_VOCAB, get_spec, register_model

# name -> (llama size it is built from, rank, note)
COLA_SIZES: dict[str, tuple[str, int, str]] = {
    "cola-tiny": ("llama-tiny", 16, "tests; llama-tiny with r = d/4"),
    "cola-20m": ("llama-20m", 128, "CPU default; llama-20m with r = d/4 = 128"),
    "cola-60m": ("llama-60m", 128, "cola.txt Table 5 (43M), r/d = 128/512"),
    "cola-130m": ("llama-130m", 256, "cola.txt Table 5 (94M), r/d = 256/768"),
    "cola-350m": ("llama-350m", 256, "cola.txt Table 5 (185M), r/d = 256/1024"),
    "cola-1b": ("llama-1b", 512, "cola.txt Table 5 (609M), r/d = 512/2048"),
    "cola-7b": ("llama-7b", 1024, "cola.txt Table 6 / App. D, r = d/4"),
}


def _register() -> None:
    for name, (base_name, rank, note) in COLA_SIZES.items():
        base = get_spec(base_name).config
        fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
        cfg = CoLAConfig(**fields, rank=rank, both_sigma=default_both_sigma(base.d_model))
        sigma = "both σ" if cfg.both_sigma else "low-rank σ only"
        register_model(name, cfg, CoLALlamaModel, f"{note}; {sigma}")
    control = LlamaConfig(
        vocab_size=BYTE_VOCAB, d_model=384, n_layers=4, n_heads=6, d_ff=1152, max_seq_len=1024
    )
    register_model(
        "llama-20m-control",
        control,
        LlamaModel,
        "cola.txt Table 7 control: full-rank at cola-20m's FLOPs (4 x 384, d_ff 1152)",
    )


_register()
