"""Test setup: run Triton kernels in the CPU interpreter when no GPU is present.

``TRITON_INTERPRET`` must be set before any kernel is decorated, so this runs before
``ep_moe`` is imported by any test module.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ON_GPU = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def _session_cache_dir(tmp_path_factory):
    """Every test (and every process it starts) uses a fresh autotune cache of this session,
    never the user's ``~/.cache/ep_moe/autotune``; tests that need their own set it again."""
    before = os.environ.get("EP_MOE_CACHE_DIR")
    os.environ["EP_MOE_CACHE_DIR"] = str(tmp_path_factory.mktemp("ep_moe_cache"))
    yield
    if before is None:
        os.environ.pop("EP_MOE_CACHE_DIR")
    else:
        os.environ["EP_MOE_CACHE_DIR"] = before


@pytest.fixture
def tma_from_any_rows(monkeypatch):
    """Launches load through TMA wherever their config asks, at any row count: the kernel
    tests' problems are smaller than ``TMA_MIN_ROWS``, under which the kernels use pointers."""
    import ep_moe.kernels.grouped_gemm as grouped_gemm_module

    monkeypatch.setattr(grouped_gemm_module, "TMA_MIN_ROWS", 0)


@pytest.fixture
def device() -> torch.device:
    """The device tests run on: CUDA when present, else the CPU (Triton interpreter)."""
    return torch.device("cuda") if ON_GPU else torch.device("cpu")


@pytest.fixture(scope="module")
def deepspeed(tmp_path_factory):
    """DeepSpeed on its CPU accelerator, with a private extensions dir, for the drop-in's tests
    (one per test module); skips without it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ACCELERATOR", "cpu")
        mp.setenv("LOCAL_RANK", "0")
        mp.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path_factory.mktemp("torch_extensions")))
        yield pytest.importorskip("deepspeed", reason="deepspeed is not installed "
                                                      "(DS_BUILD_OPS=0 pip install deepspeed==0.19.8)")
