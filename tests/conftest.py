import atexit
import gc
import os
import shutil
import tempfile
from contextlib import nullcontext

import pytest
import torch

# Triton kernels are tested on CPU through its interpreter. Triton reads TRITON_INTERPRET when it
# is first imported (torch.compile imports it too), so set it before any test module runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite never reads or writes the user's profile cache (~/.cache/slimact/profiles): each test
# process starts with an empty one, as a clean machine has, so no result depends on what an
# earlier run left there (tests that need their own still set SLIMACT_CACHE_DIR themselves).
os.environ["SLIMACT_CACHE_DIR"] = _PROFILES = tempfile.mkdtemp(prefix="slimact-test-cache-")
atexit.register(shutil.rmtree, _PROFILES, ignore_errors=True)

# Under pytest-xdist (the README's test command runs ``-n 2``) each worker is one process on one
# core: one intra-op thread each, so two workers do not oversubscribe a 2-core machine.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from slimact.models import build_model  # noqa: E402  (after TRITON_INTERPRET: see above)
from slimact.models.common import CausalLMOutput, causal_lm_loss  # noqa: E402
from slimact.models.llama import LlamaModel  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _refs_path(request):
    """The fast suite runs the ops' plain-PyTorch refs eagerly; the CPU path that compiles them
    with inductor (``slimact.ops.compiled_ref``) runs in tests marked ``compiled_refs`` (which
    hold it to the refs bit for bit) and in the ``slow`` suite. Each compiled ref is an inductor
    compile of seconds on a cold cache, which is what a clean CI machine has: behind every
    strategy test they were most of the fast suite's time, testing the same math again."""
    keywords = request.node.keywords
    if any(k in keywords for k in ("compiled_refs", "slow", "gpu")):
        yield
        return
    from slimact.ops import compiled_ref

    with compiled_ref.eager_refs():
        yield


@pytest.fixture(autouse=True)
def _compile_backend(request, monkeypatch):
    """Fast tests compile blocks with ``aot_eager_decomp_partition``: AOTAutograd's trace,
    decompositions, min-cut partition (``activation_memory_budget``) and inlined codec hooks as
    under inductor, without inductor's code generation (seconds per graph, where inductor took
    tens on a cold cache). Tests marked ``inductor`` (what inductor itself decides: its saved
    layouts, its RNG, its kernels' numerics), ``gpu`` tests and the slow suite compile with
    inductor."""
    keywords = request.node.keywords
    if not any(k in keywords for k in ("inductor", "slow", "gpu")):
        from slimact.compiled.blocks import BACKEND_VARIABLE

        monkeypatch.setenv(BACKEND_VARIABLE, "aot_eager_decomp_partition")
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """A private token cache for tests that build corpora."""
    monkeypatch.setenv("SLIMACT_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def one_thread():
    """One intra-op thread: fast on tiny models and immune to a busy machine's oversubscription."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_causal_lm():
    """``build(arch, vocab, layers, max_pos)``: a small random Hugging Face causal LM, "llama" or
    "qwen2" (tied embeddings), seeded; skips where transformers is not installed."""
    t = pytest.importorskip("transformers")

    def build(arch: str, vocab: int = 512, layers: int = 1, max_pos: int = 32):
        dec = dict(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
        )  # fmt: skip
        torch.manual_seed(0)
        if arch == "llama":
            return t.LlamaForCausalLM(t.LlamaConfig(**dec))
        return t.Qwen2ForCausalLM(t.Qwen2Config(**dec, tie_word_embeddings=True))

    return build


class SoftCappedLlama(LlamaModel):
    """llama whose loss head soft-caps its logits as Gemma-2 does (``30 tanh(z / 30)``): more
    than linear + cross-entropy, invisible at initialization (the logits are ~0.1 there, where
    the cap changes them by 1e-5)."""

    def forward(self, input_ids, targets=None):
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(input_ids.shape[1], x.dtype)
        for block in self.layers:
            x = block(x, cos, sin)
        logits = 30.0 * torch.tanh(self.lm_head(self.norm(x)) / 30.0)
        return CausalLMOutput(logits=logits, loss=causal_lm_loss(logits, targets))


@pytest.fixture
def soft_capped_llama():
    """``build()``: llama-tiny (seeded) as a :class:`SoftCappedLlama`."""

    def build():
        torch.manual_seed(0)
        model = build_model("llama-tiny")
        model.__class__ = SoftCappedLlama
        return model

    return build


class FakeEvent:
    def __init__(self, log: list) -> None:
        self.log, self.stream = log, None

    def record(self, stream) -> None:
        self.stream = stream.name
        self.log.append(("record", stream.name, self))


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event) -> None:
        assert event.stream is not None, "waited for an event never recorded"
        self.log.append(("wait_event", self.name, event))


class FakeStreams:
    """CUDA's stream calls, recorded; accepts CPU tensors (unpinned buffers)."""

    pin = False

    def __init__(self) -> None:
        self.log: list = []
        self.main = FakeStream("main", self.log)
        self.made = 0

    def accepts(self, device) -> bool:
        return True

    def current(self, device):
        return self.main

    def new_stream(self, device):
        self.made += 1
        return FakeStream(("d2h", "h2d")[self.made - 1], self.log)

    def event(self):
        return FakeEvent(self.log)

    def use(self, stream):
        self.log.append(("use", stream.name))
        return nullcontext()

    def record_stream(self, t, stream) -> None:
        self.log.append(("record_stream", stream.name))


@pytest.fixture
def fake_streams():
    """A stand-in for CUDA's streams and events that accepts CPU tensors and logs every call:
    the offload path (``slimact.codecs.offload.using_streams``) runs on CPU with it."""
    return FakeStreams()


@pytest.fixture
def young_gc():
    """Everything alive at the test's start moved to gc's permanent generation (``gc.freeze``)
    for the test: the library's own ``gc.collect()`` calls (a peak measured after a warm-up, an
    offload check) then scan only what the test made, which is all they are there to free,
    instead of the whole process (a suite worker's heap: a fraction of a second per call)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
