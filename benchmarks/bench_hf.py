"""slimact on Hugging Face models: saved bytes ratio and gradient cosine per architecture/strategy.

Same seed, same batch, baseline vs strategy, meter bytes of one forward, min gradient cosine over
parameters (``slimact.compare.grad_cosine``). Small random-weight configs built offline (d=256,
4 layers, batch 4 x seq 256 by default), torch.set_num_threads(1). No step time is reported
(for interleaved step-time ratios see ``slimact bench`` / ``slimact memory``); the JSON's meta
records the load average all the same.

    PYTHONPATH=src python benchmarks/bench_hf.py [--d 256 --layers 4 --batch 4 --seq 256]
    python benchmarks/bench_hf.py --d 64 --layers 1 --batch 1 --seq 16 --vocab 64 \
        --out /tmp/hf.json   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

import slimact
from slimact import hf
from slimact.compare import grad_cosine
from slimact.timing import load_average

ARCHS = ("llama", "mistral", "qwen2", "gpt2", "bert")
STRATEGIES = ("invact", "recompute", "int4", "prac", "auto@50%")


def build(arch: str, d: int, layers: int, seq: int, vocab: int):
    import transformers as t

    torch.manual_seed(0)
    dec = dict(vocab_size=vocab, hidden_size=d, intermediate_size=int(d * 2.6875) // 8 * 8,
               num_hidden_layers=layers, num_attention_heads=d // 64,
               num_key_value_heads=max(1, d // 128), max_position_embeddings=seq)  # fmt: skip
    if arch == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**dec)).train()
    if arch == "mistral":
        return t.MistralForCausalLM(t.MistralConfig(**dec)).train()
    if arch == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(**dec)).train()
    if arch == "gpt2":
        cfg = t.GPT2Config(
            vocab_size=vocab,
            n_embd=d,
            n_layer=layers,
            n_head=d // 64,
            n_positions=seq,
            bos_token_id=vocab - 1,
            eos_token_id=vocab - 1,
        )
        return t.GPT2LMHeadModel(cfg).train()
    return t.BertForMaskedLM(t.BertConfig(
        vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=d // 64,
        intermediate_size=4 * d, max_position_embeddings=seq)).train()  # fmt: skip


def step(model, x, y):
    """(saved bytes, loss) of one metered forward+backward; the gradients stay in ``.grad``.

    Not timed: one step of each model after the other would compare the machine's load."""
    torch.manual_seed(3)
    with slimact.measure(model, n_tokens=x.numel()) as m:
        loss = hf.lm_loss(model, x, y)
    loss.backward()
    return m.report.total_bytes, float(loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--out", default="benchmarks/results/hf.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for arch in ARCHS:
        ids = torch.randint(
            0, a.vocab - 1, (a.batch, a.seq), generator=torch.Generator().manual_seed(1)
        )
        x, y = hf.mlm_batch(ids, a.vocab - 1, seed=2) if arch == "bert" else (ids, ids)
        base = build(arch, a.d, a.layers, a.seq, a.vocab)
        b_bytes, b_loss = step(base, x, y)
        for strategy in STRATEGIES:
            model = slimact.apply(build(arch, a.d, a.layers, a.seq, a.vocab), strategy)
            s_bytes, s_loss = step(model, x, y)
            row = dict(arch=arch, model=type(model).__name__, strategy=strategy,
                       saved_bytes=s_bytes, baseline_saved_bytes=b_bytes, ratio=s_bytes / b_bytes,
                       grad_cosine=grad_cosine(base, model), loss=s_loss, baseline_loss=b_loss,
                       skipped=len(hf.skipped(model)),
                       unhandled_top=list(hf.unhandled(slimact.measure and _report(model, x, y)).items())[:3])  # fmt: skip
            rows.append(row)
            print(
                f"{arch:8s} {strategy:10s} ratio {row['ratio']:.3f} cos {row['grad_cosine']:.4f}",
                flush=True,
            )
    meta = dict(machine=platform.processor() or platform.machine(), cores=os.cpu_count(),
                threads=1, torch=torch.__version__, command=" ".join(["python", *sys.argv]),
                d=a.d, layers=a.layers, batch=a.batch, seq=a.seq, vocab=a.vocab,
                load_avg=load_average())  # fmt: skip
    import transformers

    meta["transformers"] = transformers.__version__
    with open(a.out, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=2)


def _report(model, x, y):
    torch.manual_seed(3)
    with slimact.measure(model, n_tokens=x.numel()) as m:
        hf.lm_loss(model, x, y)
    return m.report


if __name__ == "__main__":
    main()
