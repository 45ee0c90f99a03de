"""Triton grouped GEMM kernels, their autograd wrappers and a plain-PyTorch reference.

Nothing in this package imports ``torch.distributed``.
"""
