import os

import pytest
import torch

# Triton kernels are tested on CPU through its interpreter. Triton reads TRITON_INTERPRET when it
# is first imported (torch.compile imports it too), so set it before any test module runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
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
