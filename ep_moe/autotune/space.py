"""Problems, search space and pruning rules of the grouped GEMM autotuner. Pure functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Projection = Literal["gate_up", "down"]


@dataclass(frozen=True, kw_only=True)
class GemmProblem:
    """One expert projection of one MoE layer, as its grouped GEMM sees it.

    ``gate_up`` reads tokens through a gather index (each token used ``top_k`` times) and
    writes rows in expert order; ``down`` reads rows in expert order and scatters them to
    token-slot order with the top-k weights multiplied in.
    """

    projection: Projection
    """Which projection: ``"gate_up"`` (H -> 2I or I) or ``"down"`` (I -> H)."""
    num_local_experts: int
    """Experts on this rank (E / ep_size)."""
    n: int
    """Output features of the forward GEMM (w is [E, n, k])."""
    k: int
    """Input features of the forward GEMM."""
    top_k: int
    """Experts per token."""
    dtype: str
    """Element type, e.g. ``"bfloat16"``."""
