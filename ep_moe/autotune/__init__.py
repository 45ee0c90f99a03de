"""Kernel autotuning: generate -> prune -> benchmark -> cache, coordinated across ranks."""

from ep_moe.autotune.space import GemmProblem

__all__ = ["GemmProblem"]
