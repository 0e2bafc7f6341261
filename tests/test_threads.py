"""Threads: a model per thread trains as it does alone; one model's forwards on two threads at
once are refused with a clear error (its plan runtime and codec policy hold one forward's state);
two threads planning at once leave the process's stdout where it was."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

import slimact
from slimact.models import build_model

X = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(0))


def fresh(strategy):
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    slimact.apply(model, strategy)
    return model


def train(model, steps=2):
    """``steps`` forward+backward passes; every parameter's gradient after each."""
    grads = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        model(X, targets=X).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return grads


def in_threads(*fns):
    """Run each fn on a thread of its own, at once; their results (a thread's error raised)."""
    out: list = [None] * len(fns)
    start = threading.Barrier(len(fns))

    def run(i, fn):
        try:
            start.wait(timeout=30)
            out[i] = ("ok", fn())
        except BaseException as e:  # noqa: BLE001  (handed to the main thread)
            out[i] = ("err", e)

    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for kind, value in out:
        if kind == "err":
            raise value
    return [value for _, value in out]


@pytest.mark.parametrize("strategy", ["int4", "prac"])
def test_two_models_on_two_threads_train_as_alone(strategy):
    alone = train(fresh(strategy))
    models = [fresh(strategy) for _ in range(2)]
    for grads in in_threads(*(lambda m=m: train(m) for m in models)):
        for step, want in zip(grads, alone):
            for name, g in want.items():
                torch.testing.assert_close(step[name], g, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("strategy", ["int4", "prac"])
def test_one_model_on_two_threads_at_once_is_refused(strategy):
    """Thread A is inside the model's forward (held there by a hook) when thread B calls it: B
    gets the refusal, A's step is the single-threaded one, and the model serves later calls
    from either thread."""
    alone = train(fresh(strategy), steps=1)[0]
    model = fresh(strategy)
    inside, done = threading.Event(), threading.Event()
    first = [True]

    def hold(module, args, output):
        if threading.current_thread().name == "A" and first[0]:
            first[0] = False
            inside.set()
            assert done.wait(timeout=60)

    handle = model.layers[0].register_forward_hook(hold)
    result: dict = {}

    def a():
        result["a"] = train(model, steps=1)[0]

    def b():
        assert inside.wait(timeout=60)
        try:
            model(X, targets=X)
        except RuntimeError as e:
            result["b"] = e
        finally:
            done.set()

    ta, tb = threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")
    ta.start()
    tb.start()
    ta.join(timeout=120)
    tb.join(timeout=120)
    handle.remove()
    assert isinstance(result.get("b"), RuntimeError), result.get("b")
    assert "another thread" in str(result["b"]) and "copy.deepcopy" in str(result["b"])
    for name, g in alone.items():
        torch.testing.assert_close(result["a"][name], g, rtol=0, atol=0, msg=name)
    # one after the other, from either thread: served
    (later,) = in_threads(lambda: train(model, steps=1))
    assert all(torch.isfinite(g).all() for g in later[0].values())


SOLVES = """
import os, sys, threading
import numpy as np
from slimact.planner import highs

rng = np.random.default_rng(0)
n = 30
built = highs.Rows(
    cols=[(0, "y", j) for j in range(n)], index={(0, "y", j): j for j in range(n)},
    rows=[{j: float(rng.random()) for j in range(n)} for _ in range(4)],
    lo=[1.0] * 4, hi=[np.inf] * 4, qual={},
    mem={j: float(rng.random()) * 2**20 for j in range(n)},
    obj={j: float(rng.random()) * 1e-3 for j in range(n)},
)
before = os.fstat(1)
print("before", flush=True)

def solve():
    for _ in range(30):
        assert highs.run(built, None).x is not None

threads = [threading.Thread(target=solve) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
after = os.fstat(1)
print("same fd 1", (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino), flush=True)
sys.stderr.write("done\\n")
"""


def test_threads_solving_at_once_leave_stdout_alone():
    """HiGHS prints nothing with ``disp=False``, so a solve changes no file descriptor: threads
    solving at once cannot leave fd 1 pointing at /dev/null (a save/restore of fd 1 per solve,
    interleaved between threads, did) and nothing a solve prints reaches stdout."""
    out = subprocess.run(
        [sys.executable, "-c", SOLVES],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "before\nsame fd 1 True\n", out.stdout
    assert out.stderr.endswith("done\n"), out.stderr
