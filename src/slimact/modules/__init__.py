"""Drop-in ``nn.Module`` replacements built on ``slimact.ops`` (one file per technique)."""

from slimact.modules.inv_act import InvGELU, InvLayerNorm, InvRMSNorm, InvSiLU

__all__ = ["InvGELU", "InvLayerNorm", "InvRMSNorm", "InvSiLU"]
