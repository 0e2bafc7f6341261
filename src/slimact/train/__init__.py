"""Training: ``TrainConfig`` → ``train(config)`` → ``TrainResult``; ``slimact train`` wraps it.

from slimact.train import TrainConfig, train
result = train(TrainConfig(model="llama-tiny", strategy="recompute", steps=50, batch=4, seq=128))
print(result.final_val_loss, result.tokens_per_s, result.saved_bytes)
"""

from slimact.train.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from slimact.train.config import TrainConfig
from slimact.train.logger import MetricsLog, read_metrics
from slimact.train.loop import TrainResult, evaluate, make_optimizer, train
from slimact.train.schedule import WarmupCosine

__all__ = [
    "MetricsLog",
    "TrainConfig",
    "TrainResult",
    "WarmupCosine",
    "evaluate",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "make_optimizer",
    "prune_checkpoints",
    "read_metrics",
    "save_checkpoint",
    "train",
]
