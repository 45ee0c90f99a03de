"""The trainer under FSDP2 (``parallel.fsdp = true``), on CPU.

Under ``torchrun`` (gloo, the ``tiny`` preset shortened to ``STEPS`` steps, the clip
of 1.0 biting every step): one launch per world size runs several trainer runs one after
the other in the same processes (a wrapper around the trainer's ``main``, each run
on a process group of its own), since starting the processes costs more than the runs.

- FSDP at (world 2, EP 1), (2, 2) and (4, 2) logs the losses, aux losses, global gradient
  norms and validation losses of the replicated run of that world size (same seed, same
  global batch) to ``RTOL``: the reduce-scatters average the gradients as ``sync_gradients``
  does, and the clip counts every gradient shard once (dense over all ranks, experts over
  ``edp``);
- ``--resume`` across FSDP and replicated runs, both ways, and across EP sizes: a DCP
  checkpoint of step 2 continues with the losses of the run that saved it; one of them
  with activation checkpointing;
- ``training.dtype = 'bfloat16'`` under FSDP (its MixedPrecisionPolicy, no autocast) follows
  the replicated run under bf16 autocast to bf16 rounding;
- a NaN in one rank's shard of the AdamW state stops the save on every rank (each rank
  checks its shards, one all-reduce makes the verdict common), and nothing is written.

``training.compile`` under FSDP continues a run (marked slow: Inductor compiles on the CPU).

In process: the config's checks (``parallel.fsdp`` typed; ``checkpoint.format='native'``
and ``training.cuda_graphs='on'`` refused with it), why CUDA graphs are off, a native
checkpoint refused by a sharded model (a gloo group of one).

About 25-30 s on 2 cores without the compiled run (``-m "not slow"``), nearly all of it the
two launches (9 runs at world 2, 3 at world 4); the compiled run adds 13-20 s with
Inductor's cache warm, about 35 s cold.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STEPS = 4
SAVED = 2
"""The step of the checkpoints the resumed runs start from."""
RTOL = 1e-5
"""fp32: the same math as the replicated run, summed in another order."""
BF16_RTOL = 2e-3
"""bf16 weights under FSDP against fp32 weights under bf16 autocast: measured 1e-4."""
RUN_ARGS = ["--config", "tiny", "--steps", str(STEPS), "--set", "training.batch_size=4",
            "--set", "logging.log_interval=1", "--set", f"logging.eval_interval={SAVED}",
            "--set", "logging.eval_batches=1", "--set", "logging.progress_bar=false",
            "--set", "logging.sample_prompt=''"]
FSDP = ["--set", "parallel.fsdp=true"]
FIELDS = ("loss", "aux_loss", "grad_norm", "val_loss")

WRAPPER = """
import datetime, json, logging, os, sys
import torch
import torch.distributed as dist
from ep_moe.train import train, trainer

RANK = int(os.environ["RANK"])
logging.getLogger().setLevel(logging.INFO if RANK == 0 else logging.WARNING)  # train.main's, once a handler is there
init_process_group = dist.init_process_group


def init_own_group(backend=None, **kwargs):
    # each run on a store prefix of its own: the keys of the previous run's group would mislead this one's
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=datetime.timedelta(seconds=120))
    kwargs.update(store=dist.PrefixStore(f"run{{RUN}}/", client), rank=RANK,
                  world_size=int(os.environ["WORLD_SIZE"]))
    return init_process_group(backend, **kwargs)


save_checkpoint = trainer.save_checkpoint
NAN_RANK = None


def save_with_nan(root, step, layout, model, optimizer, *args, **kwargs):
    # a NaN in this rank's shard of one AdamW moment (a DTensor: the local tensor is its storage)
    if RANK == NAN_RANK:
        param = model.get_parameter("layers.0.attn.wq.weight")
        optimizer.state[param]["exp_avg"].to_local().view(-1)[0] = float("nan")
    return save_checkpoint(root, step, layout, model, optimizer, *args, **kwargs)


dist.init_process_group, trainer.save_checkpoint = init_own_group, save_with_nan
for RUN, (name, argv, nan_rank) in enumerate(json.load(open(sys.argv[1]))):
    NAN_RANK = nan_rank
    out = os.path.join(os.path.dirname(sys.argv[1]), name)
    os.makedirs(out, exist_ok=True)
    handler = logging.FileHandler(os.path.join(out, f"log-rank{{RANK}}.txt"))
    logging.getLogger().addHandler(handler)
    outcome = {{"rc": 0, "error": None}}
    try:
        train.main(argv + ["--checkpoint-dir", os.path.join(out, "ckpt"),
                           "--metrics-file", os.path.join(out, "metrics.jsonl")])
    except SystemExit as exc:
        outcome["rc"] = exc.code
    except Exception as exc:
        outcome.update(rc=1, error=f"{{type(exc).__name__}}: {{exc}}")
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    with open(os.path.join(out, f"outcome-rank{{RANK}}.json"), "w") as f:
        json.dump(outcome, f)
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1")
    return env


def _launch(root: Path, world: int, runs: list[tuple[str, list[str], "int | None"]]) -> dict[str, SimpleNamespace]:
    """Under one ``torchrun`` of ``world`` processes, each (name, arguments, rank to put a
    NaN in before saving) run in turn; per name its metrics, rank 0's log, each rank's outcome."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "wrapper.py").write_text(WRAPPER.format())
    (root / "runs.json").write_text(json.dumps([[name, RUN_ARGS + argv, nan] for name, argv, nan in runs]))
    cmd = [str(BIN / "torchrun"), "--nproc-per-node", str(world), "--standalone", str(root / "wrapper.py"),
           str(root / "runs.json")]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    out = {}
    for name, _, _ in runs:
        metrics = root / name / "metrics.jsonl"
        out[name] = SimpleNamespace(
            records=[json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else [],
            log=(root / name / "log-rank0.txt").read_text(), ckpt=root / name / "ckpt",
            outcomes=[json.loads((root / name / f"outcome-rank{r}.json").read_text()) for r in range(world)])
    return out


def _by_step(records: list[dict], field: str, after: int = 0) -> dict[int, float]:
    return {r["step"]: r[field] for r in records if field in r and r["step"] > after}


def _assert_same_run(got: SimpleNamespace, want: SimpleNamespace, after: int = 0, rtol: float = RTOL) -> None:
    """``got`` logged ``want``'s values from step ``after + 1`` on, every field to ``rtol``."""
    for field in FIELDS:
        expected = _by_step(want.records, field, after)
        assert sorted(expected) == sorted(set(range(after + 1, STEPS + 1)) if field != "val_loss"
                                          else {s for s in (SAVED, STEPS) if s > after}), field
        assert _by_step(got.records, field) == pytest.approx(expected, rel=rtol), field


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_w2")
    save = ["--set", f"checkpoint.interval={SAVED}", "--set", "checkpoint.keep=0"]
    no_save = ["--set", "checkpoint.interval=-1"]
    ep1, ep2 = ["--ep-size", "1"], ["--ep-size", "2"]
    bf16 = ["--set", "training.dtype='bfloat16'"]

    def resume(name: str) -> list[str]:
        return no_save + ["--resume", str(root / name / "ckpt" / f"step_{SAVED:08d}")]

    return _launch(root, 2, [
        ("replicated_ep2", ep2 + save, None),
        ("fsdp_ep2", ep2 + FSDP + save, None),
        ("fsdp_ep1", ep1 + FSDP + save, None),
        ("replicated_to_fsdp", ep1 + FSDP + resume("replicated_ep2"), None),
        ("fsdp_to_replicated", ep2 + resume("fsdp_ep1"), None),
        ("fsdp_recomputed", ep1 + FSDP + resume("fsdp_ep2") + ["--set", "training.activation_checkpointing=true"],
         None),
        ("replicated_bf16", ep2 + no_save + bf16, None),
        ("fsdp_bf16", ep2 + FSDP + no_save + bf16, None),
        ("nan_on_rank1", ep2 + FSDP + save + ["--steps", str(SAVED)], 1),
    ])


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_w4")
    save = ["--ep-size", "2", "--set", f"checkpoint.interval={SAVED}", "--set", "checkpoint.keep=0"]
    resume = ["--resume", str(root / "fsdp_ep2" / "ckpt" / f"step_{SAVED:08d}"), "--set", "checkpoint.interval=-1"]
    return _launch(root, 4, [
        ("replicated_ep2", save, None),
        ("fsdp_ep2", save + FSDP, None),
        ("fsdp_ep2_to_ep4", ["--ep-size", "4"] + FSDP + resume, None),
    ])


@pytest.mark.distributed
@pytest.mark.parametrize("world, name", [(2, "fsdp_ep2"), (2, "fsdp_ep1"), (4, "fsdp_ep2")])
def test_fsdp_logs_the_replicated_run(request, world, name):
    """(world, EP) = (2, 2), (2, 1), (4, 2) under FSDP: the replicated run's losses, aux
    losses, clipped global grad norms and validation losses, every step; the log says so."""
    runs = request.getfixturevalue(f"world{world}")
    got, want = runs[name], runs["replicated_ep2"]
    ep = int(name[-1])
    assert f"world {world}, EP {ep}," in got.log and f"FSDP: dense weights sharded over {world} ranks" in got.log
    assert "FSDP:" not in want.log
    _assert_same_run(got, want)
    assert all(r["grad_norm"] > 1.0 for r in want.records if "grad_norm" in r), "the clip (1.0) must bite"


@pytest.mark.distributed
@pytest.mark.parametrize("world, name, source", [
    (2, "replicated_to_fsdp", "replicated_ep2"),
    (2, "fsdp_to_replicated", "fsdp_ep1"),
    (2, "fsdp_recomputed", "fsdp_ep2"),
    (4, "fsdp_ep2_to_ep4", "fsdp_ep2"),
])
def test_resume_across_fsdp_and_ep(request, world, name, source):
    """A DCP checkpoint of step 2 resumed replicated -> FSDP (EP 2 -> 1), FSDP -> replicated
    (EP 1 -> 2), FSDP -> FSDP with activation checkpointing (EP 2 -> 1), and at world 4
    FSDP EP 2 -> EP 4: the run that saved it goes on, to float rounding."""
    runs = request.getfixturevalue(f"world{world}")
    got = runs[name]
    assert re.search(rf"resumed from \S+/{source}/ckpt/step_{SAVED:08d} at step {SAVED}\n", got.log), got.log[-2000:]
    _assert_same_run(got, runs[source], after=SAVED)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="torch.compile on the CPU (Inductor) needs a C++ compiler")
def test_compiled_blocks_under_fsdp(world2, tmp_path):
    """Blocks compiled in place (``training.compile``, before ``apply_fsdp``: Dynamo breaks
    the graph at FSDP's hooks and the MoE layer's exchange) continue the FSDP EP 2 run from
    step 2 with its losses, to the rounding of fused kernels."""
    resumed = ["--ep-size", "2", *FSDP, "--set", "training.compile=true", "--set", "logging.eval_interval=0",
               "--set", "checkpoint.interval=-1", "--resume", str(world2["fsdp_ep2"].ckpt / f"step_{SAVED:08d}")]
    got = _launch(tmp_path, 2, [("compiled", resumed, None)])["compiled"]
    want = _by_step(world2["fsdp_ep2"].records, "loss", after=SAVED)
    assert _by_step(got.records, "loss") == pytest.approx(want, abs=1e-4)


@pytest.mark.distributed
def test_bf16_under_fsdp(world2):
    """bf16 weights in compute, fp32 reduction (FSDP's MixedPrecisionPolicy) follow bf16
    autocast over fp32 weights (the replicated run) to bf16 rounding, and differ from fp32."""
    got, want = world2["fsdp_bf16"], world2["replicated_bf16"]
    _assert_same_run(got, want, rtol=BF16_RTOL)
    assert _by_step(got.records, "loss") != _by_step(world2["fsdp_ep2"].records, "loss")


@pytest.mark.distributed
def test_non_finite_shard_is_never_saved(world2):
    """A NaN in rank 1's shard of an AdamW moment: both ranks refuse the save of step 2 (rank
    1 names the tensor, rank 0 learns it from the all-reduce), and no checkpoint is written."""
    run = world2["nan_on_rank1"]
    errors = [o["error"] or "" for o in run.outcomes]
    assert all(e.startswith(f"FloatingPointError: refusing to save the checkpoint of step {SAVED}") for e in errors)
    assert "this rank: optimizer state exp_avg of layers.0.attn.wq.weight" in errors[1], errors
    assert "(on other ranks)" in errors[0], errors
    assert not run.ckpt.exists() or not any(run.ckpt.iterdir())


# --- in process ------------------------------------------------------------------------------


@pytest.fixture
def train(monkeypatch):
    """The trainer's modules (no torchrun environment)."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    from ep_moe.train import checkpoint, config, errors, graphs, model, trainer

    return SimpleNamespace(checkpoint=checkpoint, config=config, errors=errors, graphs=graphs, model=model,
                           trainer=trainer)


def test_fsdp_config(train):
    """Off by default; typed; native checkpoints and CUDA graphs 'on' refused with it, naming
    the field, who set it and the fix."""
    parse, ConfigError = train.config.parse_args, train.errors.ConfigError
    assert parse([]).parallel.fsdp is False
    assert parse(FSDP).parallel.fsdp is True
    with pytest.raises(ConfigError, match=r"^--set parallel.fsdp=1: parallel.fsdp=1 \(int\) has the wrong type: "
                                          r"expected true or false"):
        parse(["--set", "parallel.fsdp=1"])
    with pytest.raises(ConfigError, match=r"^--set checkpoint.format='native': checkpoint.format='native' cannot "
                                          r"save the sharded weights of parallel.fsdp=true \(--set parallel.fsdp="
                                          r"true\): .*Use checkpoint.format='dcp'"):
        parse(FSDP + ["--set", "checkpoint.format='native'"])
    with pytest.raises(ConfigError, match=r"^--set training.cuda_graphs='on': training.cuda_graphs='on' does not "
                                          r"work with parallel.fsdp=true \(--set parallel.fsdp=true\): FSDP gathers "
                                          r"each block's weights .* set training.cuda_graphs='auto'"):
        parse(["--set", "training.cuda_graphs='on'"] + FSDP)
    assert parse(FSDP + ["--set", "training.cuda_graphs='off'"]).training.cuda_graphs == "off"


def test_cuda_graphs_off_under_fsdp(train):
    """``auto`` keeps the graphs off under FSDP with a reason naming it (logged by the trainer)."""
    reason = train.graphs.graphs_unsupported("all_gather", torch.device("cuda"), compile=False,
                                              activation_checkpointing=False, fsdp=True)
    assert reason.startswith("parallel.fsdp=true: FSDP gathers each block's weights")
    assert train.graphs.graphs_unsupported("all_gather", torch.device("cuda"), compile=False,
                                            activation_checkpointing=False) is None


def test_native_checkpoint_is_refused_by_a_sharded_model(train, tmp_path):
    """A native checkpoint does not load into a model sharded with FSDP, nor does a sharded
    model save one: both say why and what to do (a gloo group of one)."""
    from ep_moe.parallel import apply_fsdp, init_parallel_mesh

    small = ["--set", "model.dim=32", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
             "--set", "moe.num_experts=4", "--set", "moe.intermediate_size=32"]
    job = train.config.parse_args(small)
    layout = train.checkpoint.Layout(rank=0, world_size=1, ep_rank=0, ep_size=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        def build(fsdp: bool):
            torch.manual_seed(0)
            net = train.model.MoETransformer(job.model, job.moe_config(), None)
            if fsdp:
                apply_fsdp(net, init_parallel_mesh(1, device_type="cpu"))
            return net, train.trainer.build_optimizer(net, job.training, torch.device("cpu"))

        net, optimizer = build(fsdp=False)
        path = train.checkpoint.save_checkpoint(tmp_path, 1, layout, net, optimizer, {"step": 1, "data": {"step": 1}},
                                                 {"config": job.to_dict()}, 0, format="native")
        net, optimizer = build(fsdp=True)
        with pytest.raises(train.errors.CheckpointError, match=rf"^cannot resume from checkpoint {path}: it is in "
                                                                r"the native format .* parallel.fsdp=false"):
            train.checkpoint.load_checkpoint(path, layout, net, optimizer, job.to_dict())
        with pytest.raises(ValueError, match=r"format='native' saves replicated dense weights, but the model is "
                                             r"sharded"):
            train.checkpoint.save_checkpoint(tmp_path, 2, layout, net, optimizer, {"step": 2, "data": {"step": 2}},
                                              {"config": job.to_dict()}, 0, format="native")
    finally:
        dist.destroy_process_group()
