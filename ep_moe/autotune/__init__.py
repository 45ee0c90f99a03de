"""Kernel autotuning: generate -> prune -> benchmark -> cache, coordinated across ranks.

``space`` (pure: problems, candidates, pruning, heuristic) -> ``bench`` (timing) ->
``cache`` (JSON files) -> ``coordinate`` (lookup chain, warmup across ranks).

Use :func:`warmup` once on every rank before training, then :func:`get_kernel_configs`
on every layer call.
"""

from ep_moe.autotune.bench import Tuner, device_limits
from ep_moe.autotune.coordinate import (
    ResolvedConfigs,
    WarmupTimeout,
    clear_memory_cache,
    collect_problems,
    get_kernel_configs,
    resolve,
    warmup,
)
from ep_moe.autotune.space import DeviceLimits, GemmProblem, ModelShape

__all__ = [
    "DeviceLimits",
    "GemmProblem",
    "ModelShape",
    "ResolvedConfigs",
    "Tuner",
    "WarmupTimeout",
    "clear_memory_cache",
    "collect_problems",
    "device_limits",
    "get_kernel_configs",
    "resolve",
    "warmup",
]
