"""``MoEConfig.dispatch="auto"``: which dispatch :func:`ep_moe.ep.resolve_dispatch` picks.

The all-gather on NCCL groups where it sends at most about twice what the all-to-all may
(``ep_size <= 2 * top_k``) and its worst-case buffers stay within ``AUTO_GATHER_MAX_WORST`` times the average
rows; the all-to-all everywhere else (gloo, larger EP). The group's backend is faked: the
rule reads only its name.
"""

from __future__ import annotations

import pytest

import ep_moe.ep as ep
from ep_moe import MoEConfig


def _config(**kwargs) -> MoEConfig:
    return MoEConfig(hidden_size=8, intermediate_size=8, **kwargs)


@pytest.fixture
def backend(monkeypatch):
    """``backend.name``: what ``dist.get_backend`` answers for any group."""
    state = type("Backend", (), {"name": "nccl"})()
    monkeypatch.setattr(ep.dist, "get_backend", lambda group=None: state.name)
    return state


@pytest.mark.parametrize("experts, top_k, size, want", [
    (32, 4, 2, "all_gather"),    # gpu.toml at EP=2: worst case 2x the average rows
    (32, 4, 4, "all_gather"),    # EP=4: worst case 4x
    (128, 8, 4, "all_gather"),   # qwen3-shaped at EP=4
    (32, 4, 8, "all_to_all"),    # worst case 8x the average rows
    (64, 8, 8, "all_to_all"),    # worst case 8x
    (16, 8, 8, "all_gather"),    # 2 experts a rank: worst case 2x
    (8, 2, 2, "all_gather"),
    (8, 2, 4, "all_gather"),     # mixtral-shaped at EP=4: 2 ranks a token at most, of 4
    (16, 2, 4, "all_gather"),    # the DeepSpeed drop-in's GPU bench
    (64, 2, 8, "all_to_all"),    # more than twice top_k ranks: the all-gather would send more
    (8, 1, 2, "all_gather"),     # top-1 at EP=2
    (8, 1, 4, "all_to_all"),     # top-1 at EP=4
])
def test_auto_on_nccl(backend, experts, top_k, size, want):
    assert ep.resolve_dispatch(_config(num_experts=experts, top_k=top_k), object(), size) == want


@pytest.mark.parametrize("name", ["gloo", "mpi"])
def test_auto_elsewhere_is_the_all_to_all(backend, name):
    backend.name = name
    assert ep.resolve_dispatch(_config(num_experts=32, top_k=4), object(), 2) == "all_to_all"


def test_mixed_backend_group_counts_as_nccl(backend):
    backend.name = "cpu:gloo,cuda:nccl"
    assert ep.resolve_dispatch(_config(num_experts=32, top_k=4), object(), 2) == "all_gather"


@pytest.mark.parametrize("dispatch", ["all_to_all", "all_gather", "all_gather_copy_engine"])
def test_explicit_choice_is_kept(backend, dispatch):
    assert ep.resolve_dispatch(_config(num_experts=32, top_k=4, dispatch=dispatch), object(), 8) == dispatch


def test_ep1_is_local(backend):
    assert ep.resolve_dispatch(_config(num_experts=32, top_k=4), None, 1) == "local"
    assert _config(num_experts=4, top_k=2).dispatch == "auto"
