"""The models and batches of one bench case, and the short training run of one point.

* :func:`build`: the case's model from the suite's seed (random weights), at the case's
  vocabulary (``vocab_size``; default the byte tokenizer's 257 tokens, BERT's own 30,522).
* :class:`Data`: the measurement batch, the training batches and fixed validation batches, from
  the corpus (byte tokens, ``BatchLoader`` from the suite's seed) or, with ``vocab_size``, random
  ids in ``[0, vocab)`` from seeded generators (memory and speed do not depend on the ids; the
  loss curve then only shows that every point trains alike). BERT's batches are masked with
  ``slimact.hf_inputs.mlm_batch``.
* :func:`train_point`: ``train_steps`` AdamW steps (``slimact.train.make_optimizer``,
  ``WarmupCosine``, clipping 0.5), the loss curve and the validation loss after them. ``auto``
  runs its plan evolver as ``slimact train`` does; its sampling is switched off afterwards so it
  does not run during the timing rounds. The optimizer (and its state) is freed on return.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from slimact.bench.cases import HF_MODELS, MASK_TOKEN_ID, ModelCase
from slimact.data import BatchLoader, ByteTokenizer, fixed_batches
from slimact.hf_inputs import lm_loss, mlm_batch
from slimact.models import build_model
from slimact.planner import PlanEvolver
from slimact.train import WarmupCosine, make_optimizer
from slimact.utils import seed_everything


def build(
    model_name: str, device: torch.device, seed: int, vocab_size: int | None = None
) -> nn.Module:
    """The model of a case, built from ``seed`` (random weights) on ``device``, in train mode,
    at ``vocab_size`` (default: the byte tokenizer's, or BERT's own 30,522)."""
    seed_everything(seed)
    if model_name in HF_MODELS:
        from transformers import BertConfig, BertForMaskedLM  # optional: slimact[hf]

        cfg = BertConfig() if vocab_size is None else BertConfig(vocab_size=vocab_size)
        model = BertForMaskedLM(cfg)
    else:
        model = build_model(model_name, vocab_size=vocab_size or ByteTokenizer().vocab_size)
    return model.to(device).train()


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return lm_loss(model, x, y)


class Data:
    """Batches of one case: the measurement batch, a training loader, fixed val batches.

    From the corpus ``splits``, or with ``case.vocab_size`` random ids in ``[0, vocab)`` from
    seeded generators (``splits`` unused)."""

    def __init__(self, case: ModelCase, splits: Any, seed: int, device: torch.device) -> None:
        self.mlm = case.model in HF_MODELS
        self.device = device
        self.case, self.splits, self.seed = case, splits, seed
        if case.vocab_size is not None:
            self.batch = self._prep(self._random(torch.Generator().manual_seed(seed + 1)), 0)
            gen = torch.Generator().manual_seed(seed + 10_000)
            self.val = [self._prep(self._random(gen), 10_000 + i) for i in range(case.eval_batches)]
            return
        self.batch = self._prep(
            BatchLoader(splits.train, case.batch, case.seq, seed + 1).next_batch(), 0
        )
        val = fixed_batches(splits.val, case.batch, case.seq, case.eval_batches)
        self.val = [self._prep(b, 10_000 + i) for i, b in enumerate(val)]

    def _random(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.case
        t = torch.randint(0, c.vocab_size, (c.batch, c.seq + 1), generator=gen)
        return t[:, :-1], t[:, 1:]

    def _prep(self, b: tuple[torch.Tensor, torch.Tensor], mask_seed: int):
        x, y = b
        if self.mlm:
            x, y = mlm_batch(x, MASK_TOKEN_ID, seed=self.seed + mask_seed)
        return x.to(self.device), y.to(self.device)

    def train_batches(self):
        if self.case.vocab_size is not None:
            gen = torch.Generator().manual_seed(self.seed)
            step = 0
            while True:
                step += 1
                yield self._prep(self._random(gen), step)
        loader = BatchLoader(self.splits.train, self.case.batch, self.case.seq, self.seed)
        step = 0
        while True:
            step += 1
            yield self._prep(loader.next_batch(), step)


def train_point(model, forward, data: Data, case: ModelCase, seed: int) -> dict:
    """The short training run of one point (module docstring); returns its ``train`` record."""
    seed_everything(seed)
    opt = make_optimizer(model, case.lr, 0.01)
    sched = WarmupCosine(case.lr, case.train_steps, max(1, case.train_steps // 10), 0.1)
    params = [p for g in opt.param_groups for p in g["params"]]
    losses, t_train = [], 0.0
    device = data.device
    with tempfile.TemporaryDirectory() as tmp:
        evolver = PlanEvolver.for_model(model, log_path=Path(tmp) / "plan_changes.jsonl")
        batches = data.train_batches()
        try:
            for step in range(case.train_steps):
                sched.set_lr(opt, step)
                x, y = next(batches)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = forward(model, x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
                value = float(loss.detach().float().item())
                t_train += time.perf_counter() - t0
                if not math.isfinite(value):
                    raise FloatingPointError(f"training loss became {value} at step {step + 1}")
                losses.append(value)
                if evolver is not None:
                    evolver.on_step(step + 1, model)
        finally:
            if evolver is not None:
                evolver.rt.observer = None  # no sampling during the timing rounds
    with torch.no_grad():
        was = model.training
        model.eval()
        val = [float(loss_fn(model, x, y).float().item()) for x, y in data.val]
        model.train(was)
    out = {
        "steps": case.train_steps,
        "losses": losses,
        "final_train_loss": losses[-1],
        "val_loss": sum(val) / len(val),
        "train_tokens_per_s": case.train_steps * case.tokens_per_step / t_train,
    }
    if evolver is not None:
        out["plan_changes"] = sum(1 for e in evolver.events if e.get("applied"))
    return out
