"""Test setup: run Triton kernels in the CPU interpreter when no GPU is present.

``TRITON_INTERPRET`` must be set before any kernel is decorated, so this runs before
``ep_moe`` is imported by any test module.
"""

import os
import shutil
import tempfile

# Inductor's on-disk caches key a graph by its code, not by a custom op's fake: a graph compiled
# against an earlier fake would be reused. This test run, and every process it starts, caches in
# a folder of its own, removed at the end (read when torch loads Inductor's config: set first).
_INDUCTOR_CACHE = None if "TORCHINDUCTOR_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="ep_moe_inductor_")
if _INDUCTOR_CACHE is not None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ON_GPU = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip_gpu)


FAULT_CLASSES = ("clean", "unclear", "crash", "hang", "wrong")
"""How a fault probe (a test under tests/faults/) ended: passed; skipped or expected to fail;
failed raising an exception; failed running out of time; failed an assertion on what it
got (a lost file, a silent wrong result)."""


def fault_class(report) -> str:
    """The class of one test report of the fault suite (:data:`FAULT_CLASSES`)."""
    if report.passed:
        return "clean"
    if report.skipped or hasattr(report, "wasxfail"):
        return "unclear"
    text = str(report.longrepr)
    if "Timeout" in text or "timed out" in text:
        return "hang"
    crash = getattr(report.longrepr, "reprcrash", None)
    return "wrong" if crash is not None and crash.message.startswith("AssertionError") else "crash"


def pytest_terminal_summary(terminalreporter):
    """The fault suite's tally, one line: probes tried and how they ended."""
    reports = [r for outcome in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
               for r in terminalreporter.stats.get(outcome, [])
               if "tests/faults/" in r.nodeid and (r.when == "call" or not r.passed)]
    if reports:
        tally = {name: 0 for name in FAULT_CLASSES}
        for report in reports:
            tally[fault_class(report)] += 1
        terminalreporter.write_line(f"fault probes: tried {len(reports)} | " +
                                    " | ".join(f"{name} {count}" for name, count in tally.items()))


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


@pytest.fixture
def quantizations(monkeypatch) -> list:
    """The weights given FP8 copies so far in the test (each ``QuantizedWeight`` made by
    :func:`ep_moe.kernels.fp8.quantized_weight`), in order."""
    from ep_moe.kernels import fp8

    made = []
    real = fp8.QuantizedWeight

    def counted(w, version=None):
        made.append(w)
        return real(w, version)
    monkeypatch.setattr(fp8, "QuantizedWeight", counted)
    return made


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


def pytest_unconfigure(config):
    if _INDUCTOR_CACHE is not None:
        shutil.rmtree(_INDUCTOR_CACHE, ignore_errors=True)
