"""Offload under ``torch.compile``: a compiled block that keeps only its input, in host memory.

A compiled region saves with hooks disabled (``slimact.compiled.blocks``), and the offload
engine (``slimact.codecs.offload``: pinned pool, side streams, events) is Python that a graph
cannot trace. So the offload choice (``BlockChoice(0, "none", offload=True)``) keeps what
crosses the block boundary *outside* the compiled graph, checkpoint-style, in an eager
``autograd.Function`` around the block's compiled call:

* forward: the block's input goes to the engine (device-to-host copy on its stream, after the
  kernel that made it), then the compiled block runs without grad: its inference graph, which
  saves nothing;
* backward: the input comes back (its copy was started one block ahead by the engine's
  prefetch, overlapping the later block's backward), the compiled block runs again with grad
  (at compile's default partition, budget 1: its saves are consumed at once) and its backward
  gives the gradients of the input, of the block's parameters (inputs of the Function, so
  ``torch.autograd.grad`` sees them as any other graph does) and of any other input that
  needs one.

Memory: the device holds no saved tensor of the block between its forward and backward, only
the block input's pinned host copy (``sites.hold`` reports it to the meter as host bytes, site
``<block>:checkpoint_input#0``, action ``offload``, as the eager ``offload`` strategy's).
Time: one forward more than compile's budget-0 partition would not recompute anyway, plus
whatever copy time the following block's compute does not hide (the planner's stall model,
``slimact.planner.offload``). Gradients: those of the same compiled block at budget 1, the
forward replayed with the RNG state it first ran under.

A block with dropout is refused: its compiled inference graph and its compiled training graph
draw their masks differently, so the replay would not see the forward's masks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from slimact import sites
from slimact.codecs.offload import Lease, check_device, engine_for

ROLE = "checkpoint_input"  # the site name of the offloaded input, as the eager offload's


def refuse_dropout(block: nn.Module) -> None:
    """One-line refusal of a block whose forward draws random masks (module docstring)."""
    for name, m in block.named_modules():
        p = getattr(m, "p", 0.0) if isinstance(m, nn.modules.dropout._DropoutNd) else 0.0
        if p > 0:
            raise ValueError(
                f"offload under compile replays a block's forward in backward, and "
                f"{type(block).__name__} has dropout ({name or 'itself'}, p={p}) whose masks a "
                "compiled replay would draw anew; use compiled-recompute, or the eager "
                "'offload' strategy (apply without compile=True)"
            )


class OffloadedCall:
    """The compiled call of one block under the offload choice: ``compiled(forward, *args,
    **kwargs)`` is the block's compiled function (``slimact.compiled.blocks``), ``params`` the
    block's trainable parameters. ``copies=False`` keeps the input on the device instead (the
    planner times the option without the link, whose cost it models)."""

    def __init__(self, compiled: Callable[..., Any], block: nn.Module) -> None:
        self.compiled = compiled
        self.params = [p for p in block.parameters() if p.requires_grad]
        self.copies = True
        refuse_dropout(block)

    def __call__(self, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
            return self.compiled(forward, *args, **kwargs)
        flat, spec = tree_flatten((args[1:], kwargs))
        grads = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor) and v.requires_grad]
        if not args[0].requires_grad and not grads and not self.params:
            return self.compiled(forward, *args, **kwargs)
        if self.copies:
            check_device(args[0].device)
        box: dict[str, Any] = {}
        outs = _Offloaded.apply(
            self, forward, spec, flat, grads, box, args[0], *self.params,
            *(flat[i] for i in grads),
        )  # fmt: skip
        return tree_unflatten(list(outs), box["spec"])


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    dev = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), dev


class _Offloaded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, forward, spec, flat, grads, box, x, *tensors):  # type: ignore[override]
        ctx.call, ctx.forward, ctx.spec, ctx.flat, ctx.grads = call, forward, spec, flat, grads
        ctx.n_params = len(call.params)
        ctx.device, ctx.x_grad = x.device, x.requires_grad
        ctx.rng = _rng_state(x.device)
        if call.copies:
            eng = engine_for(x.device)
            ctx.lease: Lease | None = eng.save(x)
            ctx.x = None
            sites.hold(x, ROLE, host=[ctx.lease.buf])
        else:
            ctx.lease, ctx.x = None, x.detach()
        ctx.save_for_backward(*tensors[ctx.n_params :])  # other inputs needing a gradient
        rest_args, kwargs = tree_unflatten(flat, spec)
        with torch.no_grad():
            out = call.compiled(forward, x, *rest_args, **kwargs)
        outs, box["spec"] = tree_flatten(out)
        ctx.out_tensor = [isinstance(o, torch.Tensor) for o in outs]
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs)

    @staticmethod
    def backward(ctx, *grad_outs):  # type: ignore[override]
        call = ctx.call
        if ctx.lease is not None:
            x = engine_for(ctx.device).load(ctx.lease)
            ctx.lease = None
        else:
            x, ctx.x = ctx.x, None
        x = x.detach().requires_grad_(ctx.x_grad)
        flat = list(ctx.flat)
        others = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
        for i, t in zip(ctx.grads, others):
            flat[i] = t
        rest_args, kwargs = tree_unflatten(flat, ctx.spec)
        devices = [ctx.device] if ctx.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            torch.set_rng_state(ctx.rng[0])
            if ctx.rng[1] is not None:
                torch.cuda.set_rng_state(ctx.rng[1], ctx.device)
            out = call.compiled(ctx.forward, x, *rest_args, **kwargs)
        outs, _ = tree_flatten(out)
        pairs = [
            (o, g)
            for o, g in zip(outs, grad_outs)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        leaves = [x, *call.params, *others]
        want = [t for t in leaves if t.requires_grad]
        got = iter(
            torch.autograd.grad([o for o, _ in pairs], want, [g for _, g in pairs],
                                allow_unused=True)
            if pairs else [None] * len(want)
        )  # fmt: skip
        res = [next(got) if t.requires_grad else None for t in leaves]
        return (None, None, None, None, None, None, *res)


__all__ = ["OffloadedCall", "ROLE", "refuse_dropout"]
