"""ep_moe: an expert-parallel Mixture-of-Experts layer for PyTorch training.

Public surface: :func:`grouped_gemm` (fused Triton grouped GEMM with autograd),
:class:`MoELayer` and its config, :mod:`ep_moe.autotune`, and
:mod:`ep_moe.integrations.deepspeed`.
"""

from ep_moe import _version
from ep_moe.kernels.config import GemmConfigs, KernelConfig
from ep_moe.kernels.ops import grouped_gemm
from ep_moe.layer import MoEConfig, MoELayer

__all__ = ["GemmConfigs", "KernelConfig", "MoEConfig", "MoELayer", "grouped_gemm"]
__version__ = _version.__version__
