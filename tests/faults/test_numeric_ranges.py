"""Issue 46, part 2: values that are finite but absurd, refused where they are given.

Each probe gives one number that used to pass every check and fail later, far from its
cause (an ``OverflowError`` inside the capacity mask, a raw allocator error, a step-1 error
blaming ``training.lr``, minutes of silent corpus generation, 384 of 400 tokens dropped),
and asserts an error at construction that names the key, the value, the allowed range and
the fix. Then the tables themselves: every numeric field of ``MoEConfig``, of the
trainer's config dataclasses and of the DeepSpeed drop-in's arguments has a rule, and each
rule's bounds are the ones the code enforces (the bound passes, one past it fails). Last,
the trainer's memory estimate: it counts the parameters the model really has, and a
config that cannot fit the host is refused before anything is allocated.

Everything runs on the CPU in a few seconds.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from pathlib import Path

import pytest
import torch
from torch import nn

from ep_moe import MoEConfig, MoELayer
from ep_moe.integrations.deepspeed import MoE

pytestmark = pytest.mark.faults

REPO = Path(__file__).resolve().parents[2]
NAN, INF = float("nan"), float("inf")
H, I, E = 16, 32, 4
TINY = ["--set", "model.dim=32", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
        "--set", "moe.num_experts=4", "--set", "moe.intermediate_size=32", "--set", "moe.top_k=2",
        "--set", "training.batch_size=2", "--set", "training.seq_len=16", "--set", "training.device='cpu'",
        "--set", "logging.eval_interval=0", "--set", "data.synthetic_bytes=8192"]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(H, I, bias=False), nn.GELU(), nn.Linear(I, H, bias=False))


# --- MoEConfig ---------------------------------------------------------------------------

def test_moe_config_refuses_an_absurd_capacity_factor():
    """Was: accepted, then ``OverflowError: int too big to convert`` in ``capacity_keep_mask``
    at the first forward (``ceil(1e300 * T * K / E)`` does not fit an int64)."""
    with pytest.raises(ValueError, match=r"^MoEConfig.capacity_factor=1e\+300: must be <= 65536; allowed: 0 < "
                                         r"capacity_factor <= 65536, or None; pass None for dropless routing"):
        MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, capacity_factor=1e300)


def test_the_largest_capacity_factor_runs_and_keeps_every_slot():
    """The bound is one the layer computes with: no overflow, nothing dropped."""
    from ep_moe.config import MAX_CAPACITY_FACTOR

    cfg = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, capacity_factor=MAX_CAPACITY_FACTOR,
                    backend="torch")
    layer = MoELayer(cfg)
    layer(torch.randn(400, H))
    assert int(layer.last_stats.num_dropped) == 0


@pytest.mark.parametrize("field, value, expected", [
    ("hidden_size", 2**40, r"hidden_size=1099511627776: must be <= 1048576; allowed: 1 <= hidden_size <= 1048576"),
    ("num_experts", 2**20, r"num_experts=1048576: must be <= 65536; allowed: 1 <= num_experts <= 65536"),
    ("init_std", 1e30, r"init_std=1e\+30: must be <= 1; allowed: 0 < init_std <= 1; the usual std is 0.02"),
    ("aux_loss_coef", 1e30, r"aux_loss_coef=1e\+30: must be <= 100; allowed: 0 <= aux_loss_coef <= 100"),
    ("all_gather_row_bound", 1e300, r"all_gather_row_bound=1e\+300: .*allowed: 0 < all_gather_row_bound <= 65536"),
])
def test_moe_config_upper_bounds(field, value, expected):
    with pytest.raises(ValueError, match=expected):
        MoEConfig(**{**dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2), field: value})


# --- the DeepSpeed drop-in -----------------------------------------------------------------

@pytest.mark.parametrize("name", ["capacity_factor", "eval_capacity_factor"])
@pytest.mark.parametrize("value", [NAN, INF, -INF, 1e300])
def test_deepspeed_drop_in_refuses_a_capacity_factor_that_is_not_finite_or_absurd(name, value):
    """Was: accepted; ``capacity()`` then cast inf or NaN to int64 and every expert kept
    ``min_capacity`` tokens: 384 of 400 dropped, silently (eval mode for the eval factor)."""
    with pytest.raises(ValueError, match=rf"^{name}={re.escape(repr(value))} .*allowed: 0 <= {name} <= 65536"):
        MoE(H, _mlp(), num_experts=E, **{name: value})


def test_deepspeed_drop_in_at_the_largest_capacity_factor_drops_nothing():
    from ep_moe.integrations.deepspeed_gate import MAX_CAPACITY_FACTOR

    for k in (1, 2, 3):
        moe = MoE(H, _mlp(), num_experts=E, k=k, capacity_factor=MAX_CAPACITY_FACTOR,
                  eval_capacity_factor=MAX_CAPACITY_FACTOR)
        for training in (True, False):
            moe.train(training)
            moe(torch.randn(400, H))
            assert int(moe.layer.last_stats.num_dropped) == 0, (k, training)


@pytest.mark.parametrize("kwargs, expected", [
    (dict(min_capacity=2**63), r"^min_capacity=9223372036854775808 .*allowed: 0 <= min_capacity <= 2147483647"),
    (dict(min_capacity=1.5), r"^min_capacity=1.5 must be an int"),
    (dict(capacity_factor="1"), r"^capacity_factor='1' must be a finite number"),
    (dict(num_experts=2**20), r"^num_experts=1048576 .*allowed: 1 <= num_experts <= 65536"),
    (dict(hidden_size=0), r"^hidden_size=0 must be a positive int"),
    (dict(ep_size=0), r"^ep_size=0 must be a positive int"),
])
def test_deepspeed_drop_in_numeric_arguments(kwargs, expected):
    args = {**dict(hidden_size=H, expert=_mlp(), num_experts=E), **kwargs}
    with pytest.raises(ValueError, match=expected):
        MoE(**args)


@pytest.mark.parametrize("expert, got", [(lambda x: x, "got function <function"), ("mlp", "got str 'mlp'"),
                                         (nn.Linear, "got the class Linear: pass an instance of it")])
def test_deepspeed_drop_in_expert_that_is_not_a_module(expert, got):
    """Was: ``AttributeError: 'function' object has no attribute 'named_modules'``."""
    with pytest.raises(TypeError, match=rf"^expert must be an nn.Module: .*{re.escape(got)}"):
        MoE(H, expert, num_experts=E)


def test_every_numeric_argument_of_the_drop_in_has_a_rule():
    from ep_moe.integrations.deepspeed_gate import ARGUMENT_RULES, DeepSpeedGate

    hints = typing.get_type_hints(MoE.__init__)
    numeric = {name for name in inspect.signature(MoE.__init__).parameters if name in hints
               and (int in typing.get_args(hints[name]) + (hints[name],) or float in typing.get_args(hints[name])
                    + (hints[name],))}
    numeric |= {f.name for f in dataclasses.fields(DeepSpeedGate) if f.type in ("int", "float")}
    assert numeric == set(ARGUMENT_RULES), numeric ^ set(ARGUMENT_RULES)


# --- the trainer's config ------------------------------------------------------------------

ABSURD = {
    # was: minutes (hours at 1e11) of silent corpus generation
    "data.synthetic_bytes=100000000000": r"data.synthetic_bytes=100000000000 .*use a token file",
    # was: a raw allocator error when the model is built
    "model.vocab_size=1099511627776": r"model.vocab_size=1099511627776 must be <= .*allowed: 1 <= model.vocab_size",
    "model.max_seq_len=1099511627776": r"model.max_seq_len=1099511627776 must be <= .*allowed: 1 <= model.max_seq_len",
    # was: an overflow in data.py's window order at step 1
    "training.seed=9223372036854775807": r"training.seed=9223372036854775807 must be <= 17592186044415.*1_000_003",
    # was: "normal expects std >= 0" when the model is built
    "model.init_std=nan": r"model.init_std=nan must be finite .*allowed: 0 < model.init_std <= 1",
    # were: a non-finite loss at step 1, blamed on training.lr
    "model.rope_theta=-1": r"model.rope_theta=-1.0 must be > 1; allowed: 1 < model.rope_theta <=",
    "model.norm_eps=nan": r"model.norm_eps=nan must be finite .*allowed: 0 < model.norm_eps <= 1",
    # were: accepted
    "parallel.autotune_timeout_s=nan": r"parallel.autotune_timeout_s=nan must be finite .*allowed: 0 < ",
    "parallel.autotune_timeout_s=-5": r"parallel.autotune_timeout_s=-5.0 must be > 0; allowed: 0 < ",
    "training.lr=1e30": r"training.lr=1e\+30 must be <= 10; allowed: 0 < training.lr <= 10",
    "logging.sample_tokens=1000000000": r"logging.sample_tokens=1000000000 must be <= 65536",
}


@pytest.mark.parametrize("assignment", sorted(ABSURD))
def test_absurd_trainer_value_is_refused_naming_the_key(train, assignment):
    with pytest.raises(train.errors.ConfigError) as err:
        train.config.parse_args([*TINY, "--set", assignment])
    message = str(err.value)
    assert message.startswith(f"--set {assignment}: "), message
    assert re.search(ABSURD[assignment], message), message


def test_synthetic_bytes_is_not_checked_when_a_data_file_is_used(train, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world\n" * 100)
    job = train.config.parse_args([*TINY, "--data", str(corpus), "--set", "data.synthetic_bytes=100000000000"])
    assert job.data.synthetic_bytes == 10**11


def test_the_largest_seed_runs_data_order(train):
    """``training.seed``'s bound is data.py's real one: the validation split seeds its
    window order with ``(seed + 1) * 1_000_003 + epoch``, which must fit torch's 64-bit
    seed; at the largest seed, late epochs still draw, one past it is refused."""
    top = train.config.MAX_SEED
    tokens = torch.arange(64, dtype=torch.int64) % 256
    for seed in (top, top + 1):  # the training split, then the validation split (seed + 1)
        batches = train.data.TokenBatches(tokens, seq_len=8, batch_size=2, dp_rank=0, dp_size=1, seed=seed)
        batches.batch(10**9)  # epoch ~ 3e8
    assert train.config.TrainingConfig(seed=top).seed == top
    with pytest.raises(ValueError, match=rf"training.seed={top + 1} must be <= {top}"):
        train.config.TrainingConfig(seed=top + 1)
    with pytest.raises(ValueError, match=r"training.seed=-1 must be >= 0"):
        train.config.TrainingConfig(seed=-1)


def test_weight_decay_times_lr_must_stay_below_one(train):
    """AdamW's decoupled decay multiplies each weight by ``1 - lr * weight_decay`` per step."""
    with pytest.raises(ValueError, match=r"training.lr \* training.weight_decay = 2 \(training.lr=2.0, "
                                         r"training.weight_decay=1.0\) must be < 1"):
        train.config.TrainingConfig(lr=2.0, weight_decay=1.0)


def _numeric_fields(cls) -> set[str]:
    hints = typing.get_type_hints(cls)
    return {f.name for f in dataclasses.fields(cls)
            if hints[f.name] in (int, float) or typing.get_origin(hints[f.name]) is tuple}


def test_every_numeric_trainer_field_has_a_rule(train):
    sections = {"training": train.config.TrainingConfig, "parallel": train.config.ParallelConfig,
                "logging": train.config.LoggingConfig}
    covered = {key for key in train.config.RANGES}
    for section, cls in sections.items():
        missing = {f"{section}.{name}" for name in _numeric_fields(cls)} - covered
        assert not missing, missing
    assert {f"model.{name}" for name in _numeric_fields(train.model.ModelConfig)} == set(train.model.MODEL_RANGES)


def _bounds_hold(cls, section: str, ranges: dict, base: dict):
    """For every rule of ``section``: its bounds pass, one step past them fails naming the key."""
    checked = 0
    for key, rule in ranges.items():
        if not key.startswith(f"{section}."):
            continue
        name = key.partition(".")[2]
        pair = isinstance(getattr(cls(**base), name), tuple)
        step = 1 if rule.integer else max(abs(rule.hi or rule.lo) * 1e-6, 1e-9)
        inside = [rule.lo + (step if rule.lo_open else 0)] + ([rule.hi] if rule.hi is not None else [])
        outside = [rule.lo - step if not rule.lo_open else rule.lo] + ([rule.hi + step] if rule.hi is not None
                                                                     else [])
        if not rule.integer:
            outside += [NAN, INF]
        for value in inside:
            value = (value, value) if pair else value
            try:
                cls(**{**base, name: value})
            except ValueError as exc:  # a cross-field rule may refuse it: then not for this key's range
                assert "allowed:" not in str(exc) or key not in str(exc), (key, value, exc)
        for value in outside:
            value = (value, value) if pair else value
            with pytest.raises(ValueError, match=rf"^{re.escape(key)}=.*allowed: "):
                cls(**{**base, name: value})
        checked += 1
    return checked


def test_each_trainer_rule_is_the_bound_enforced(train):
    c, m = train.config, train.model
    assert _bounds_hold(c.TrainingConfig, "training", c.RANGES, dict(weight_decay=0.0)) >= 10
    assert _bounds_hold(c.ParallelConfig, "parallel", c.RANGES, {}) == 2
    assert _bounds_hold(c.LoggingConfig, "logging", c.RANGES, {}) == 4
    assert _bounds_hold(m.ModelConfig, "model", m.MODEL_RANGES, dict(dim=64, n_heads=1, head_dim=2)) >= 9


def test_moe_config_every_numeric_rule_has_an_upper_bound():
    from ep_moe.config import _RULES

    base = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2)
    for name, rule in _RULES.items():
        if rule.maximum is None:
            continue
        value = rule.maximum + 1 if isinstance(rule.maximum, int) else rule.maximum * 2
        with pytest.raises(ValueError, match=rf"^MoEConfig.{name}=.*allowed: .*{name} <= "):
            MoEConfig(**{**base, name: value})
    numeric = [f.name for f in dataclasses.fields(MoEConfig) if f.type in ("int", "float", "Optional[float]",
                                                                             "Optional[int]")]
    assert all(_RULES[name].maximum is not None for name in numeric), numeric


# --- the memory estimate ---------------------------------------------------------------------

@pytest.mark.parametrize("extra", [[], ["--set", "model.tie_embeddings=true", "--set", "moe.num_shared_experts=1",
                                        "--set", "moe.mlp_bias=true", "--set", "model.n_kv_heads=1"],
                                   ["--set", "moe.activation='gelu'", "--set", "model.qk_norm=false",
                                    "--set", "moe.num_shared_experts=2", "--set", "moe.shared_intermediate_size=40"],
                                   ["--set", "moe.num_linears=1", "--set", "moe.activation='identity'",
                                    "--set", "moe.mlp_bias=true", "--set", "moe.num_shared_experts=2"]])
def test_memory_estimate_counts_the_model_parameters(train, extra):
    job = train.config.parse_args([*TINY, *extra])
    net = train.model.MoETransformer(job.model, job.moe_config(), None)
    parts = train.config.memory_estimate(job)
    params = sum(p.numel() for p in net.parameters())
    assert parts["parameters"] == 4 * params
    assert parts["gradients"] == 4 * params and parts["optimizer"] == 8 * params
    assert parts["logits"] == 2 * 4 * 2 * 16 * job.model.vocab_size
    # the peak: the gradients at the optimizer step, or the logits at the loss, never both at once
    assert train.config.estimate_memory_bytes(job) == parts["parameters"] + parts["optimizer"] + parts[
        "rotary tables"] + max(parts["gradients"], parts["logits"])


def test_memory_estimate_splits_the_experts_over_ep(train):
    job = train.config.parse_args([*TINY, "--set", "parallel.ep_size=2"])
    one = train.config.parse_args(TINY)
    moe = job.moe_config()
    experts = job.model.n_layers * moe.num_experts * (moe.gate_up_size + moe.intermediate_size) * moe.hidden_size
    assert train.config.memory_estimate(one)["parameters"] - train.config.memory_estimate(
        job, world_size=2)["parameters"] == 4 * experts // 2
    # ep_size 0 is the world size
    assert train.config.memory_estimate(one, world_size=2) == train.config.memory_estimate(job, world_size=2)


def test_a_config_larger_than_the_host_is_refused_before_allocation(train):
    """Each field in range, together past any host: 2**24 ids x 2**16 dims is an 8 TiB
    embedding and head. Was: a raw allocator error (or the OOM killer) building the model."""
    with pytest.raises(train.errors.ConfigError) as err:
        train.config.parse_args([*TINY, "--set", "model.vocab_size=16777216", "--set", "model.dim=65536",
                                  "--set", "model.n_heads=512"])
    message = str(err.value)
    assert message.startswith("--set model."), message
    assert re.search(r"needs about [\d.]+ TiB of host memory.*more than this host's [\d.]+ GiB", message), message
    assert "model.vocab_size" in message and "model.dim" in message


def test_check_memory_on_a_small_host(train):
    job = train.config.parse_args(TINY)
    need = train.config.estimate_memory_bytes(job)
    train.config.check_memory(job, host_bytes=need, on_host=True)
    with pytest.raises(train.errors.ConfigError, match=r"training state .* host memory"):
        train.config.check_memory(job, host_bytes=need - 1, on_host=True)
    # trained on a GPU, the host only builds the fp32 parameters (and the rotary tables)
    build = train.config.host_build_bytes(job)
    assert build == train.config.memory_estimate(job)["parameters"] + train.config.memory_estimate(job)[
        "rotary tables"]
    train.config.check_memory(job, host_bytes=build, on_host=False)
    with pytest.raises(train.errors.ConfigError, match=r"float32 parameters each rank builds on the host"):
        train.config.check_memory(job, host_bytes=build - 1, on_host=False)
    with pytest.raises(train.errors.ConfigError, match=r"2 ranks on this host"):
        train.config.check_memory(job, host_bytes=need, on_host=True, ranks_per_host=2)
