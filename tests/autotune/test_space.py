"""Search space, pruning and heuristic: pure functions of (problem, device limits)."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from ep_moe.autotune.space import (
    HEURISTIC_BUCKETS,
    MAX_STAGES,
    DeviceLimits,
    GemmProblem,
    ModelShape,
    TunedBucket,
    block_m_limit,
    bucket_bounds,
    bucket_for,
    config_smem,
    default_config,
    heuristic_config,
    heuristic_table,
    initial_candidates,
    prune,
    refinements,
)
from ep_moe.kernels.config import DEFAULT_CONFIGS, PASSES, TMA_MIN_ROWS, KernelConfig, fit_to_smem, smem_bytes

H100 = DeviceLimits(name="NVIDIA H100 80GB HBM3", smem_per_block=232448, num_sms=132, capability=(9, 0))
A100 = DeviceLimits(name="NVIDIA A100-SXM4-80GB", smem_per_block=166912, num_sms=108, capability=(8, 0))
SMALL_SMEM = DeviceLimits(name="small", smem_per_block=64 * 1024, num_sms=16, capability=(8, 6))

MIXTRAL_UP = GemmProblem(projection="gate_up", num_local_experts=8, n=28672, k=4096, top_k=2, dtype="bfloat16")
QWEN_DOWN = GemmProblem(projection="down", num_local_experts=128, n=2048, k=768, top_k=8, dtype="bfloat16")
ODD_K = GemmProblem(projection="down", num_local_experts=4, n=64, k=45, top_k=2, dtype="float16")


def test_smem_estimate_formulas():
    c = KernelConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_stages=3)
    assert config_smem(c, "forward", MIXTRAL_UP) == (128 * 64 + 64 * 256) * 2 * 3
    assert config_smem(c, "dx", ODD_K) == (128 * 64 + 64 * 256) * 2 * 3
    assert config_smem(c, "dw", MIXTRAL_UP) == (128 * 256 + 128 * 64) * 2 * 3
    # with TMA, dW's output tile leaves through a shared-memory buffer outside the pipeline
    tma = dataclasses.replace(c, use_tma=True)
    assert config_smem(tma, "dw", MIXTRAL_UP) == ((128 * 256 + 128 * 64) * 3 + 256 * 64) * 2
    assert config_smem(tma, "forward", MIXTRAL_UP) == config_smem(c, "forward", MIXTRAL_UP)


def test_dw_stages_count_the_store_buffer_once():
    """The deepest dW pipeline that fits counts the TMA store's buffer once, not per stage:
    on an H100/H200 the default 64x128x256 tile keeps its 3 stages (212,992 of 232,448
    bytes) in the heuristic's config and the tuner's candidates."""
    assert default_config(MIXTRAL_UP, "dw", H100).num_stages == 3
    assert heuristic_config(MIXTRAL_UP, "dw", 65536, H100).num_stages == 3
    for c in initial_candidates(MIXTRAL_UP, "dw", 65536, H100):
        deeper = dataclasses.replace(c, num_stages=c.num_stages + 1)
        assert c.num_stages == MAX_STAGES or config_smem(deeper, "dw", MIXTRAL_UP) > H100.smem_per_block, c


@pytest.mark.parametrize("smem, expected", [
    (166912, dict(num_stages=2, use_tma=True, BLOCK_M=64)),  # A100: the store buffer still counted
    (101376, dict(num_stages=2, use_tma=False, BLOCK_M=64)),  # 99 KiB: no TMA before a shorter step
    (65536, dict(num_stages=2, use_tma=False, BLOCK_M=32)),  # 64 KiB: then the step halves
])
def test_dw_default_fits_smaller_gpus_by_dropping_tma_before_its_tile(smem, expected):
    fitted = fit_to_smem(DEFAULT_CONFIGS["dw"], "dw", 2, smem)
    assert smem_bytes(fitted, "dw", 2) <= smem
    assert {k: getattr(fitted, k) for k in expected} == expected


def test_default_is_what_the_kernels_run_untuned():
    from ep_moe.kernels.config import GemmConfigs

    for dev in (H100, SMALL_SMEM):
        fitted = GemmConfigs.defaults(2, dev.smem_per_block)
        assert all(default_config(MIXTRAL_UP, p, dev) == fitted.for_pass(p) for p in PASSES)
    assert default_config(MIXTRAL_UP, "forward", H100) == DEFAULT_CONFIGS["forward"]


@pytest.mark.parametrize("dev", [H100, A100, SMALL_SMEM])
@pytest.mark.parametrize("problem", [MIXTRAL_UP, QWEN_DOWN, ODD_K])
@pytest.mark.parametrize("which", PASSES)
@pytest.mark.parametrize("rows", [64, 4096, 65536])
def test_candidates_default_first_and_rest_pruned(dev, problem, which, rows):
    cands = initial_candidates(problem, which, rows, dev)
    assert cands[0] == default_config(problem, which, dev)
    assert len(set(cands)) == len(cands)
    rest = cands[1:]
    assert prune(rest, problem, which, rows, dev) == rest
    for c in rest:
        assert config_smem(c, which, problem) <= dev.smem_per_block
        assert c.BLOCK_M <= block_m_limit(problem, rows)
    for best in cands[:2]:
        for r in refinements(best, problem, which, rows, dev):
            assert r != best and config_smem(r, which, problem) <= dev.smem_per_block
    assert len(cands) + 2 * 5 <= 30, "search stays small enough to tune on a GPU in minutes"


def test_block_m_limit_follows_rows_per_expert():
    # 128 experts, 4096 rows: 32 per expert -> at most 64-row tiles; floor 32.
    assert block_m_limit(QWEN_DOWN, 4096) == 64
    assert block_m_limit(QWEN_DOWN, 16) == 32
    assert block_m_limit(MIXTRAL_UP, 65536) >= 256
    cands = initial_candidates(QWEN_DOWN, "forward", 4096, H100)[1:]
    assert cands and max(c.BLOCK_M for c in cands) == 64


def test_tma_only_on_hopper_with_aligned_rows():
    tma = KernelConfig(use_tma=True)
    assert prune([tma], MIXTRAL_UP, "forward", 65536, H100) == [tma]
    assert prune([tma], MIXTRAL_UP, "dw", 65536, H100) == [tma]
    assert prune([tma], MIXTRAL_UP, "dw", TMA_MIN_ROWS - 1, H100) == []  # the kernels use pointers there
    assert prune([tma], MIXTRAL_UP, "forward", 65536, A100) == []
    assert prune([tma], ODD_K, "forward", 4096, H100) == []  # weight rows of 45 halves
    odd_n = GemmProblem(projection="down", num_local_experts=4, n=45, k=64, top_k=2, dtype="float16")
    assert prune([tma], odd_n, "forward", 4096, H100) == [tma]  # w rows are k wide
    assert prune([tma], odd_n, "dw", 4096, H100) == []  # dy rows are n wide
    assert any(r.use_tma for r in refinements(DEFAULT_CONFIGS["forward"], MIXTRAL_UP, "forward", 65536, H100))
    assert not any(r.use_tma for r in refinements(DEFAULT_CONFIGS["forward"], MIXTRAL_UP, "forward", 65536, A100))
    assert all(c.use_tma for c in initial_candidates(MIXTRAL_UP, "dw", 65536, H100))
    assert not any(c.use_tma for c in initial_candidates(MIXTRAL_UP, "dw", 65536, A100)[1:])


def test_pure_inputs_untouched():
    cands = initial_candidates(MIXTRAL_UP, "forward", 4096, H100)
    before = copy.deepcopy(cands)
    prune(cands, MIXTRAL_UP, "forward", 16, SMALL_SMEM)
    refinements(cands[1], MIXTRAL_UP, "forward", 16, SMALL_SMEM)
    assert cands == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        H100.smem_per_block = 0  # type: ignore[misc]


@pytest.mark.parametrize("dev", [H100, SMALL_SMEM])
@pytest.mark.parametrize("problem", [MIXTRAL_UP, QWEN_DOWN, ODD_K])
def test_heuristic_fits_and_tracks_rows(dev, problem):
    for rows in HEURISTIC_BUCKETS:
        for which in PASSES:
            c = heuristic_config(problem, which, rows, dev)
            assert config_smem(c, which, problem) <= dev.smem_per_block
            assert c.BLOCK_M <= block_m_limit(problem, rows)
            assert c.use_tma == (default_config(problem, which, dev).use_tma and dev.capability >= (9, 0)
                                 and problem is not ODD_K and rows >= TMA_MIN_ROWS)
    assert heuristic_config(QWEN_DOWN, "forward", 1024, dev).BLOCK_M == 32  # 8 rows per expert
    assert heuristic_config(QWEN_DOWN, "forward", 65536, dev).BLOCK_M == 128
    assert set(heuristic_table(problem, dev)) == set(HEURISTIC_BUCKETS)


def test_buckets():
    assert bucket_for(8192 * 8) == 65536
    assert bucket_for(2800) == 2048 and bucket_for(3000) == 4096  # log-space midpoint 2896
    assert bucket_for(0) == 16
    assert bucket_bounds((1024, 4096)) == (2048.0,)


def test_tuned_bucket_json_round_trip():
    import json

    entry = heuristic_table(MIXTRAL_UP, H100, (4096,))[4096]
    assert TunedBucket.from_dict(json.loads(json.dumps(entry.to_dict()))) == entry


def test_model_shape_problems_and_errors():
    shape = ModelShape(name="deepseek-v3", num_experts=256, hidden_size=7168, intermediate_size=2048, top_k=8)
    up, down = shape.problems(8, "bfloat16")
    assert (up.projection, up.num_local_experts, up.n, up.k) == ("gate_up", 32, 4096, 7168)
    assert (down.projection, down.n, down.k) == ("down", 7168, 2048)
    with pytest.raises(ValueError, match="ep_size=3"):
        shape.problems(3, "bfloat16")
    with pytest.raises(ValueError, match="dtype='int8'"):
        shape.problems(1, "int8")
    with pytest.raises(ValueError, match="top_k=9 exceeds num_experts=8"):
        ModelShape(name="x", num_experts=8, hidden_size=8, intermediate_size=8, top_k=9)
    with pytest.raises(ValueError, match="unknown fields"):
        ModelShape.from_dict({"name": "x", "experts": 8})
