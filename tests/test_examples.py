"""``examples/``: each script runs as a user would start it (a subprocess: ``python`` or
``torchrun`` with 2 processes), exits 0 and prints its result line; where the script trains,
the printed task loss falls.

The environment is the test process's (conftest's ``TRITON_INTERPRET=1`` on a CPU-only
machine, which the Triton examples would set themselves, and its session autotune cache),
plus one OpenMP thread per process and, for DeepSpeed, its CPU accelerator with a private
extensions directory (as ``tests/test_deepspeed.py``). About 35 s on 2 cores.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
LOSS = re.compile(r"task loss (\d+\.\d+) -> (\d+\.\d+)")
# Two ranks: two CPU processes, or two GPUs (one per rank) where CUDA is visible.
two_ranks = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                               reason="needs 2 GPUs (one per rank) where CUDA is visible")


def _run(script: str, tmp_path: Path, nproc: int = 0, env: dict[str, str] | None = None) -> str:
    """Run ``examples/<script>`` (under torchrun with ``nproc`` processes when given) from
    ``tmp_path``; returns its stdout after checking the exit code."""
    cmd = [sys.executable, str(EXAMPLES / script)]
    if nproc:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _result_line(stdout: str, prefix: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith(prefix + ":")]
    assert len(lines) == 1, f"expected one line starting {prefix!r}:\n{stdout[-3000:]}"
    return lines[0]


def _loss_falls(line: str) -> None:
    first, last = map(float, LOSS.search(line).groups())
    assert last < first, line


def test_layer_ep1(tmp_path):
    line = _result_line(_run("layer_ep1.py", tmp_path), "layer_ep1")
    _loss_falls(line)


@pytest.mark.distributed
@two_ranks
def test_layer_ep2_torchrun(tmp_path):
    line = _result_line(_run("layer_ep2_torchrun.py", tmp_path, nproc=2), "layer_ep2")
    assert line.startswith("layer_ep2: world 2, EP 2,"), line
    _loss_falls(line)


@pytest.mark.distributed
@two_ranks
def test_deepspeed_dropin(tmp_path):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed==0.19.8)")
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"
    line = _result_line(_run("deepspeed_dropin.py", tmp_path, nproc=2, env=env), "deepspeed_dropin")
    assert line.startswith("deepspeed_dropin: world 2, ep_size 2, engine has MoE layers: True,"), line
    _loss_falls(line)


def test_grouped_gemm(tmp_path):
    line = _result_line(_run("grouped_gemm.py", tmp_path), "grouped_gemm")
    assert "output and 4 gradients match the loop" in line, line


def test_warmup_and_train(tmp_path):
    cache = tmp_path / "cache"  # empty: warmup tunes and writes the configs here
    first = _result_line(_run("warmup_and_train.py", tmp_path, env={"EP_MOE_CACHE_DIR": str(cache)}),
                         "warmup_and_train")
    assert first.startswith("warmup_and_train: configs from tuned,"), first
    _loss_falls(first)
    assert any(cache.glob("*.json"))


def test_transformers_qwen3_moe(tmp_path):
    pytest.importorskip("transformers")
    line = _result_line(_run("transformers_qwen3_moe.py", tmp_path), "transformers_qwen3_moe")
    assert line.startswith("transformers_qwen3_moe: world 1, 8 of 8 experts per rank,"), line
    assert "model.safetensors" in line, line
    _loss_falls(line)


@pytest.mark.distributed
@two_ranks
def test_transformers_qwen3_moe_torchrun(tmp_path):
    pytest.importorskip("transformers")
    line = _result_line(_run("transformers_qwen3_moe.py", tmp_path, nproc=2), "transformers_qwen3_moe")
    assert line.startswith("transformers_qwen3_moe: world 2, 4 of 8 experts per rank,"), line
    _loss_falls(line)


@pytest.mark.parametrize("script, module, extra", [("deepspeed_dropin.py", "deepspeed", "deepspeed"),
                                                   ("transformers_qwen3_moe.py", "transformers", "transformers")])
def test_examples_name_their_extra_when_it_is_missing(script, module, extra, tmp_path):
    """Without its extra's package, an example exits at once with one line naming the install."""
    blocked = f"import runpy, sys; sys.modules[{module!r}] = None; runpy.run_path({str(EXAMPLES / script)!r}, " \
              "run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", blocked], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (f"examples/{script} needs "
                                                    f"{'DeepSpeed' if extra == 'deepspeed' else 'transformers 5'}: "
                                                    f"pip install 'ep-moe[{extra}]'")
