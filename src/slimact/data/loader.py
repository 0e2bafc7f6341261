"""Batches of next-token windows: ``(x, y)`` LongTensors of shape (B, S), ``y`` = ``x`` shifted.

Training batches: each epoch cuts the train stream into non-overlapping windows of ``S + 1``
tokens starting at a random offset in ``[0, S)`` and visits them in a random order; both come from
``numpy.random.default_rng([seed, epoch])``. The loader's whole state is therefore three ints
(epoch, position within the epoch, seed) plus the shape: ``state_dict()`` goes into a checkpoint
and ``load_state_dict()`` makes a resumed run draw exactly the batches the uninterrupted run would
have. A batch that runs past the end of an epoch continues in the next one.

Validation batches are a fixed set of windows spread evenly over the val stream, no randomness.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

Batch = tuple[torch.Tensor, torch.Tensor]


def _windows(tokens: np.ndarray, starts: np.ndarray, seq: int) -> Batch:
    idx = starts[:, None] + np.arange(seq + 1)[None, :]
    block = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return block[:, :-1].contiguous(), block[:, 1:].contiguous()


def _check_shape(tokens: np.ndarray, batch: int, seq: int, split: str) -> None:
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if seq < 1:
        raise ValueError(f"seq must be >= 1, got {seq}")
    if tokens.ndim != 1:
        raise ValueError(f"{split} tokens must be a 1-D array, got shape {tokens.shape}")
    if tokens.size < seq + 1:
        raise ValueError(
            f"the {split} split has {tokens.size} tokens, fewer than seq + 1 = {seq + 1}; "
            f"use a smaller --seq or more data"
        )


@dataclass(frozen=True)
class _Epoch:
    offset: int
    order: np.ndarray


class BatchLoader:
    """Deterministic, resumable random windows over one token stream."""

    def __init__(self, tokens: np.ndarray, batch: int, seq: int, seed: int = 0) -> None:
        _check_shape(tokens, batch, seq, "train")
        self.tokens = tokens
        self.batch = batch
        self.seq = seq
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._cached: tuple[int, _Epoch] | None = None

    def _epoch(self, epoch: int) -> _Epoch:
        if self._cached is None or self._cached[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            max_offset = min(self.seq - 1, self.tokens.size - self.seq - 1)
            offset = int(rng.integers(0, max_offset + 1)) if max_offset > 0 else 0
            n_windows = (self.tokens.size - 1 - offset) // self.seq
            self._cached = (epoch, _Epoch(offset, rng.permutation(n_windows)))
        return self._cached[1]

    @property
    def windows_per_epoch(self) -> int:
        return int(self._epoch(self.epoch).order.size)

    def next_batch(self) -> Batch:
        starts: list[np.ndarray] = []
        need = self.batch
        while need:
            ep = self._epoch(self.epoch)
            take = ep.order[self.position : self.position + need]
            starts.append(ep.offset + take.astype(np.int64) * self.seq)
            need -= take.size
            self.position += take.size
            if self.position >= ep.order.size:
                self.epoch, self.position = self.epoch + 1, 0
        return _windows(self.tokens, np.concatenate(starts), self.seq)

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Small picklable state (ints only) for checkpoints."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "batch": self.batch,
            "seq": self.seq,
            "num_tokens": int(self.tokens.size),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        mine = self.state_dict()
        for field in ("batch", "seq", "num_tokens"):
            if int(state[field]) != mine[field]:
                raise ValueError(
                    f"loader state has {field}={int(state[field])}, this loader has "
                    f"{field}={mine[field]}; resume with the same data, --batch and --seq"
                )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        if not 0 <= self.position < self.windows_per_epoch:
            raise ValueError(
                f"loader position {self.position} is outside epoch {self.epoch}'s "
                f"{self.windows_per_epoch} windows"
            )


def fixed_batches(tokens: np.ndarray, batch: int, seq: int, num_batches: int) -> list[Batch]:
    """``num_batches`` batches of evenly spread windows (fewer if the stream is short).

    The last batch may hold fewer than ``batch`` rows when the stream has fewer windows than
    ``batch * num_batches``; callers should weight batch losses by their row count.
    """
    _check_shape(tokens, batch, seq, "validation")
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    n_windows = (tokens.size - 1) // seq
    count = min(batch * num_batches, n_windows)
    starts = (np.arange(count, dtype=np.int64) * n_windows // count) * seq
    return [_windows(tokens, starts[i : i + batch], seq) for i in range(0, count, batch)]
