"""Relative errors of the GPU tests, and the worst one each test file saw.

``rel_err`` is the relative Frobenius error every GPU comparison uses. ``within`` checks it
against a tolerance and keeps the largest error per file, which ``tests/gpu/conftest.py``
prints at the end of the run: the margin between what the kernels do and the tolerance, the
number to look at before tightening or loosening one.
"""

from __future__ import annotations

import torch

WORST: dict[str, tuple[float, str]] = {}
"""Per test file (its ``__name__``): the largest relative error checked, and what it was."""


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64; 0 when both are zero (an expert no token chose)."""
    diff, ref = (a.double() - b.double()).norm(), b.double().norm()
    return 0.0 if diff == 0 else (diff / ref.clamp_min(1e-30)).item()


def within(err: float, tol: float, what: str, source: str) -> bool:
    """``err < tol``, keeping ``err`` as ``source``'s worst if it is."""
    if err > WORST.get(source, (-1.0, ""))[0]:
        WORST[source] = (err, what)
    return err < tol
