"""Traced codecs on a device: eager round trips, then the whole gradient of llama-tiny under
compiled-int8/-int4 against exact autograd (overall cosine), fp32 and bf16 autocast, plus one CPU
run as the control.

    SLIMACT_TRACED_CODECS_ON_CUDA=1 PYTHONPATH=src python benchmarks/gpu_codec_diag.py cuda
"""

import copy
import sys
import time

import torch
import torch.nn.functional as F

import slimact
from slimact.compiled import CODECS, decode, encode
from slimact.models import build_model


def run(dev, bf16, strat, model="llama-tiny"):
    t0 = time.time()
    torch.manual_seed(0)
    base = build_model(model).to(dev)
    x = torch.randint(0, 257, (2, 129), device=dev)

    def grads(m):
        m.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
            loss = m(x[:, :-1], targets=x[:, 1:]).loss
        loss.backward()
        return torch.cat([p.grad.flatten().float() for p in m.parameters()])

    g0 = grads(base)
    m = slimact.apply(copy.deepcopy(base), strat)
    grads(m)
    g = grads(m)
    print(
        f"{dev} bf16={bf16} {strat}: grad cos {F.cosine_similarity(g, g0, 0).item():.6f} ({time.time() - t0:.0f} s)",
        flush=True,
    )


dev = sys.argv[1]
# eager round trip of the traced codec on this device: contiguous and transposed inputs
for name in ("int8", "int4"):
    for t in (torch.randn(64, 256, device=dev), torch.randn(256, 64, device=dev).t()):
        y = decode(encode(CODECS[name], t))
        print(
            dev,
            name,
            "roundtrip",
            tuple(t.stride()),
            "cos",
            F.cosine_similarity(y.flatten().float(), t.flatten().float(), 0).item(),
            flush=True,
        )
for args in [
    (dev, False, "compiled-int8"),
    (dev, True, "compiled-int8"),
    (dev, False, "compiled-none"),
    ("cpu", False, "compiled-int8"),
    (dev, False, "compiled-int4"),
]:
    try:
        run(*args)
    except Exception as e:
        print(args, "failed:", type(e).__name__, str(e)[:300], flush=True)
