"""Real tuning under the Triton interpreter: the benchmark data runs each projection's exact
kernel mode, candidates are validated and timed, and warmup writes a usable cache file."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from _dist import TINY, TINY_UP, isolated  # noqa: F401
from triton.runtime.errors import OutOfResources

from ep_moe.autotune import Tuner, clear_memory_cache, get_kernel_configs, warmup
from ep_moe.autotune.bench import PassLaunch, Timing, time_configs, wall_clock_timer
from ep_moe.autotune.cache import cache_dir, read_file
from ep_moe.kernels.config import DEFAULT_CONFIGS, PASSES, KernelConfig
from ep_moe.kernels.reference import grouped_gemm_reference

SMALL = KernelConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_SIZE_M=2, num_warps=4, num_stages=2)
ROWS = 64  # 32 tokens x top-2


def _expected(problem, which, launch: PassLaunch) -> torch.Tensor:
    """What the pass computes, from the float64 reference (dW through its autograd)."""
    r, s, w = launch.routing, launch.sets[0], launch.w_ENK.double()
    m = r.m_sizes
    rw = r.row_weights.double()
    ref = lambda *a, **kw: grouped_gemm_reference(*a, **kw, compute_dtype=torch.float64)  # noqa: E731
    if which == "forward":
        x = s["a"].double()
        if problem.projection == "gate_up":
            return ref(x, w, m, gather_index=r.gather)
        return ref(x, w, m, scatter_index=r.scatter, row_weights=rw)
    if which == "dx":
        dy, w_t = s["a"].double(), w.transpose(1, 2)
        if problem.projection == "gate_up":  # rows land at `position` (sorted by token)
            return ref(dy, w_t, m, scatter_index=r.position)
        return ref(dy, w_t, m, gather_index=r.scatter) * rw[r.scatter.long()][:, None]
    w = w.clone().requires_grad_()
    x, dy = s["x"].double(), s["dy"].double()
    if problem.projection == "gate_up":
        ref(x, w, m, gather_index=r.gather).backward(dy)
    else:
        ref(x, w, m, scatter_index=r.scatter, row_weights=rw).backward(dy)
    return w.grad


@pytest.mark.parametrize("problem", [TINY_UP, TINY], ids=["gate_up", "down"])
@pytest.mark.parametrize("which", PASSES)
def test_bench_data_runs_each_projections_kernel_mode(problem, which):
    launch = PassLaunch(problem, which, ROWS, torch.device("cpu"))
    assert int(launch.routing.m_sizes.sum()) == ROWS and launch.routing.m_sizes.numel() == 4
    assert sorted(launch.routing.scatter.tolist()) == list(range(ROWS))
    out = launch(SMALL, 0).double()
    expected = _expected(problem, which, launch)
    assert ((out - expected).norm() / expected.norm()).item() < 1e-5


class _FakeLaunch:
    """Stands in for PassLaunch: config -> output, optionally failing or wrong."""

    def __init__(self, bad: dict):
        self.out = torch.zeros(4, 2)
        self.bad = bad

    def __call__(self, config, index=None):
        kind = self.bad.get(config)
        if kind == "oor":
            raise OutOfResources(300000, 232448, "shared memory")
        if kind != "unwritten":  # leaves the NaN poison in place
            self.out.fill_(2.0 if kind == "wrong" else 1.0)
        return self.out


def test_failing_unwritten_and_wrong_candidates_are_skipped():
    unwritten, a, b, c = (KernelConfig(BLOCK_M=m) for m in (16, 32, 64, 128))
    launch = _FakeLaunch({unwritten: "unwritten", b: "oor", c: "wrong"})
    timer = lambda fn: Timing(1.0, 0.9, 1.1)  # noqa: E731
    results, ref = time_configs(launch, [unwritten, a, b, c], "float32", timer)
    assert results == [None, Timing(1.0, 0.9, 1.1), None, None]
    assert torch.equal(ref, torch.ones(4, 2))


def _times(*values):
    it = itertools.cycle(values)
    return lambda fn: Timing(next(it), 0.0, 0.0)


@pytest.mark.parametrize("other_ms, chosen", [(0.98, "default"), (0.9, "other")])
def test_default_kept_unless_clearly_beaten(isolated, other_ms, chosen):
    other = SMALL
    tuner = Tuner(timer=_times(1.0, other_ms), refine_top=0, progress=False,
                  candidates=lambda p, w, rows, dev: [DEFAULT_CONFIGS[w], other])
    table = tuner(TINY, __import__("ep_moe.autotune", fromlist=["x"]).device_limits(), (ROWS,))
    for which in PASSES:
        picked = table[ROWS].configs.for_pass(which)
        assert picked == (DEFAULT_CONFIGS[which] if chosen == "default" else other)
        assert table[ROWS].timings[which][0].config == picked
        assert table[ROWS].default_ms[which] == 1.0


def test_one_lucky_timing_does_not_replace_the_default(isolated):
    """The challenger reads 20% faster once, then 10% slower in the head-to-head rounds."""
    per_pass = [1.0, 0.8] + [1.0, 1.1] * 3
    timings = iter(per_pass * len(PASSES))
    tuner = Tuner(timer=lambda fn: Timing(next(timings), 0.0, 0.0), refine_top=0, progress=False,
                  candidates=lambda p, w, rows, dev: [DEFAULT_CONFIGS[w], SMALL])
    table = tuner(TINY, __import__("ep_moe.autotune", fromlist=["x"]).device_limits(), (ROWS,))
    for which in PASSES:
        assert table[ROWS].configs.for_pass(which) == DEFAULT_CONFIGS[which]
        assert {t.config: t.median_ms for t in table[ROWS].timings[which]} == {DEFAULT_CONFIGS[which]: 1.0,
                                                                                 SMALL: 1.1}
    assert next(timings, None) is None  # exactly the rounds described


@pytest.mark.slow
def test_end_to_end_tuning_in_the_interpreter(isolated):
    tuner = Tuner(timer=lambda fn: wall_clock_timer(fn, repeats=2), refine_top=0, progress=False,
                  candidates=lambda p, w, rows, dev: [DEFAULT_CONFIGS[w], SMALL])
    result = warmup([TINY_UP, TINY], num_tokens=ROWS // 2, tuner=tuner)
    for problem in (TINY_UP, TINY):
        r = result[problem]
        assert r.source == "tuned" and set(r.table) == {ROWS}
        entry = r.table[ROWS]
        for which in PASSES:
            assert entry.configs.for_pass(which) in (DEFAULT_CONFIGS[which], SMALL)
            assert len(entry.timings[which]) == 2 and entry.default_ms[which] > 0
    files = sorted(cache_dir().glob("*.json"))
    assert len(files) == 2
    for f in files:
        data, why = read_file(f)
        assert why is None and json.loads(f.read_text())["buckets"].keys() == {str(ROWS)}
    clear_memory_cache()
    assert warmup([TINY], num_tokens=ROWS // 2, tuner=tuner)[TINY].source == "cache"
    assert get_kernel_configs(TINY, ROWS) == result[TINY].table[ROWS].configs
