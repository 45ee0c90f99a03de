"""Every EP path trains like EP=1, through the trainer on GPUs (NCCL, Triton kernels).

The GPU counterpart of ``tests/test_train_matrix.py``: ``launch/train.py`` under
``torchrun --nproc-per-node W`` (W = 4 with 4 or more GPUs, else 2) with
the ``gpu`` preset cut to 2 layers, 4 sequences of 1024 tokens per GPU and a 4 MB
corpus (``SHRINK``), seed 0 and so the same global batch, ``STEPS`` steps, every step
logged to the metrics file. The reference is EP=1 (the W GPUs purely data parallel, each
with all 32 experts), once per ``training.dtype`` (module-scoped cache); each case of
``CASES`` runs EP>1 on the same W GPUs and compares every step's loss and global gradient
norm (before clipping) with it, within ``RTOL``:

- ``bfloat16`` (fp32 weights and AdamW, bf16 autocast: how the trainer runs on GPUs, and
  where ``all_gather_copy_engine`` once trained on wrong gradients, a grad norm of 2448
  against 11.6 at step 1): EP=2 (on 4 GPUs that is EP2 x DP2: the experts' gradients are
  also averaged over the expert-data-parallel pairs) and EP=4, each dispatch of
  ``DISPATCHES``;
- ``float32`` (TF32 matmuls, the Triton GEMMs included; the trainer has no bf16-parameter
  mode): EP = W (``--ep-size 0``) on the copy-engine all-gather only, to keep the file short.

Kernel tuning is off (``EP_MOE_DISABLE_AUTOTUNE=1``: shipped configs or the heuristic, no
tuning at start) and NVLink multicast too (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``).
``EP_MOE_TEST_DISPATCHES`` (comma-separated names of ``DISPATCHES``) runs only some
dispatches, as in ``tests/gpu/test_ep_nccl.py``; the other cases skip.

Time, measured on 4x H100: the bf16 reference and three EP=2 cases took 266 s (about 60 s
a run, with CUDA graph capture and the first run's Triton compiles), so all 9 runs (2
references, 7 cases) take about 9 minutes; ``-k bfloat16-ep2`` and the like run a part.

Tolerances: every step of the first ``EARLY_STEPS`` within ``RTOL``, and the mean loss of the
last 10 steps within ``LATE_RTOL``. Later steps are not compared one by one: on GPUs two runs
of one configuration diverge (nondeterministic kernels amplified by training; measured, see
``LATE_RTOL``), while wrong gradients of the kind that was found move the grad norm by 2e-2
to 1e-1 and more from step 1 (2448 against 11.6). The failure message and ``-s`` print every
case's largest differences.

CUDA graphs: the trainer graphs its blocks wherever the dispatch allows (``training.cuda_graphs``
auto): the EP=1 reference and the all-gather cases run graphed, the all-to-all eagerly; each
case checks that from the log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

NUM_GPUS = torch.cuda.device_count()
WORLD = 4 if NUM_GPUS >= 4 else 2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(NUM_GPUS < 2, reason="needs at least 2 CUDA GPUs"),
]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STEPS = 30
DISPATCHES = ("all_to_all", "all_gather", "all_gather_copy_engine")
CASES = [pytest.param("bfloat16", ep, d, id=f"bfloat16-ep{ep}-{d}") for ep in (2, 4) for d in DISPATCHES] + [
    pytest.param("float32", 0, "all_gather_copy_engine", id="float32-epall-all_gather_copy_engine"),
]
"""(training.dtype, EP size, dispatch); EP size 0: all W GPUs (the trainer's convention)."""
FIELDS = ("loss", "grad_norm")
EARLY_STEPS = 5
RTOL = {"loss": 2e-3, "grad_norm": 1e-2}
"""Largest relative difference to the EP=1 run allowed in each of the first ``EARLY_STEPS``
steps, before the runs' nondeterministic kernels (attention's backward, atomics) have
diverged them (module docstring). Measured on 4x H100 at EP=2, every dispatch: at most
2.2e-4 in the loss and 2.3e-3 in the grad norm."""
LATE_RTOL = 3e-2
"""Largest relative difference of the mean loss over the last 10 steps: two eager runs of
one configuration on one GPU differ by up to 2.3e-3 in the loss and 14% in the grad norm
after 20 steps of a similar run (``benchmarks/results/train_ep_levers_NVIDIA_H200_x2.json``,
``graphs_vs_eager``), so later grad norms are not compared step by step."""
SHRINK = [
    "--set", "model.n_layers=2",
    "--set", "training.batch_size=4",
    "--set", "data.synthetic_bytes=4194304",  # every rank builds the corpus: 32 MB takes a while
]
RUN_ARGS = [
    "--config", "gpu", *SHRINK,
    "--steps", str(STEPS),
    "--set", "logging.log_interval=1",
    "--set", "logging.eval_interval=0",
    "--set", "logging.progress_bar=false",
    "--set", "logging.sample_prompt=''",
    "--set", "checkpoint.interval=-1",  # no checkpoints
]
SELECTED = tuple(os.environ.get("EP_MOE_TEST_DISPATCHES", ",".join(DISPATCHES)).split(","))
if not set(SELECTED) <= set(DISPATCHES):
    raise ValueError(f"EP_MOE_TEST_DISPATCHES={','.join(SELECTED)}: use names of {DISPATCHES}")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(EP_MOE_DISABLE_AUTOTUNE="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", OMP_NUM_THREADS="1")
    return env


def _train(out: Path, dtype: str, ep_size: int, *extra: str) -> list[dict]:
    """One trainer run on W GPUs; its metrics records (rank 0's log in ``out``)."""
    cmd = [str(BIN / "torchrun"), "--nproc-per-node", str(WORLD), "--standalone", "launch/train.py", *RUN_ARGS,
           "--set", f"training.dtype='{dtype}'", "--ep-size", str(ep_size),
           "--checkpoint-dir", str(out / "ckpt"), "--metrics-file", str(out / "metrics.jsonl"), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=480)
    log = proc.stdout + proc.stderr
    (out / "train.log").write_text(log)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert f"world {WORLD}, EP {ep_size or WORLD}," in log, "the run did not use the EP size asked for"
    assert "device cuda" in log, "the run did not train on the GPUs"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _curves(records: list[dict]) -> dict[str, list[float]]:
    """Per field, its value at steps 1..STEPS (every step logged once)."""
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, STEPS + 1)), steps
    return {field: [r[field] for r in records if "loss" in r] for field in FIELDS}


def _max_rel_diff(got: list[float], want: list[float]) -> tuple[float, int]:
    """The largest ``|got - want| / |want|`` over the steps, and its step (1-based)."""
    diffs = [abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    return diffs[worst], worst + 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``reference(dtype)``: the EP=1 run's metrics records, run once per dtype (a failed
    run fails every case of its dtype without running again)."""
    runs: dict[str, object] = {}

    def get(dtype: str) -> list[dict]:
        if dtype not in runs:
            try:
                runs[dtype] = _train(tmp_path_factory.mktemp(f"ep1_{dtype}"), dtype, 1)
            except BaseException as err:  # noqa: BLE001 - kept and raised again below
                runs[dtype] = err
        if isinstance(runs[dtype], BaseException):
            raise AssertionError(f"the EP=1 {dtype} reference run failed") from runs[dtype]
        return runs[dtype]

    return get


@pytest.mark.parametrize("dtype, ep_size, dispatch", CASES)
def test_ep_trains_like_ep1(dtype, ep_size, dispatch, reference, tmp_path):
    """EP>1 with ``dispatch`` logs the EP=1 run's losses and gradient norms, step by step."""
    if ep_size > WORLD:
        pytest.skip(f"EP={ep_size} needs {ep_size} GPUs, {NUM_GPUS} visible")
    if dispatch not in SELECTED:
        pytest.skip(f"EP_MOE_TEST_DISPATCHES={','.join(SELECTED)}")
    want = _curves(reference(dtype))
    assert want["loss"][-1] < want["loss"][0], f"the EP=1 run did not train: {want['loss']}"
    got = _curves(_train(tmp_path, dtype, ep_size, "--set", f"moe.dispatch='{dispatch}'"))
    log = (tmp_path / "train.log").read_text()
    assert f"dispatch {dispatch}" in log
    assert ("CUDA graphs off" in log) == (dispatch == "all_to_all"), "graphs on exactly where the dispatch allows"
    worst = {field: _max_rel_diff(got[field][:EARLY_STEPS], want[field][:EARLY_STEPS]) for field in FIELDS}
    late_got, late_want = (sum(c["loss"][-10:]) / 10 for c in (got, want))
    late = abs(late_got - late_want) / late_want
    print(f"{dtype} EP={ep_size or WORLD} {dispatch}, max rel diff in steps 1-{EARLY_STEPS}: "
          + ", ".join(f"{f} {d:.2e} (step {s})" for f, (d, s) in worst.items())
          + f"; mean loss of the last 10 steps {late:.2e}")
    bad = {f: w for f, w in worst.items() if not w[0] <= RTOL[f]}
    if not late <= LATE_RTOL:
        bad["mean loss, last 10 steps"] = (late, STEPS)
    assert not bad, (f"relative differences to EP=1 (max, step) over {RTOL} (late: {LATE_RTOL}): {bad}\n"
                     + "\n".join(f"{f}: EP>1 {got[f]}\n{' ' * len(f)}  EP=1 {want[f]}" for f in FIELDS))
