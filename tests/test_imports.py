"""Every module of the package imports (catches a broken import in a module no other test
reaches), and the package exposes its public surface."""

import importlib
import pkgutil

import ep_moe


def test_every_module_imports():
    names = [m.name for m in pkgutil.walk_packages(ep_moe.__path__, prefix="ep_moe.")]
    assert "ep_moe.kernels.grouped_gemm" in names and "ep_moe.integrations.deepspeed" in names
    for name in names:
        importlib.import_module(name)


def test_public_surface():
    from ep_moe.autotune import get_kernel_configs, warmup  # noqa: F401
    from ep_moe.integrations.deepspeed import MoE, replace_deepspeed_moe  # noqa: F401

    for name in ("grouped_gemm", "MoELayer", "MoEConfig", "KernelConfig", "GemmConfigs"):
        assert hasattr(ep_moe, name), name
