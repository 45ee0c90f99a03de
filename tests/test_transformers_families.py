"""Every experts class of the installed transformers (each ``@use_experts_implementation``
class of a ``transformers/models/*/modeling_*.py``), built tiny from its family's config:
with ``"ep_moe"`` it either gives ``"eager"``'s output and every gradient (hidden states,
top-k weights, each expert tensor and bias) in float32, or is refused
(:func:`ep_moe.integrations.transformers.unsupported_reason`, and the call raises naming
why). One class of each kind (layout, bias, gate) also on the Triton backend. The counts
of matched, refused and not-constructible classes are pinned to the transformers version
they were recorded with (:data:`RECORDED_WITH`; on another the summary test skips, saying to
re-record), so an ep_moe change that moves a class is noticed; ``pytest -s`` prints the
table. Focused tests (blocks, models, edge cases): tests/test_transformers.py."""

import functools
import importlib
import inspect
import os
import re

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", minversion="5")

import transformers.integrations.moe as hf_moe  # noqa: E402
import transformers.models  # noqa: E402

import ep_moe.integrations.transformers as ep_hf  # noqa: E402
from hf_models import (E, H, K, Routed, default_kernel_configs, forward_backward, mismatches,  # noqa: E402,F401
                       routing)

pytestmark = pytest.mark.usefixtures("default_kernel_configs")
"""Triton on the kernels' default configs (fast in the interpreter)."""

RECORDED_WITH = "5.24.0"
"""The transformers version the expected outcomes below were observed with: the summary test
checks them on that version only (another has other classes; each class is still checked)."""
EXPECTED_COUNTS = {"matched": 67, "refused": 1, "not constructible": 0}
"""Observed with transformers :data:`RECORDED_WITH` (68 classes)."""
EXPECTED_REFUSED = {"MuseSparkExperts": "has_post_expert_norm"}
"""Class -> a word of its refusal."""
EXPECTED_NOT_CONSTRUCTIBLE: dict = {}

TINY = dict(hidden_size=H, moe_hidden_size=H, intermediate_size=16, moe_intermediate_size=16, num_experts=E,
            n_routed_experts=E, num_local_experts=E, moe_num_experts=E, num_experts_per_tok=K, swiglu_limit=0.5)
"""The config attributes the experts classes size themselves by (each family names the
expert count its own way), set where the config has them; the SwiGLU limit low enough
that the clamps of the families that have one bite."""
MAX_NUMEL = 100_000
"""A parameter larger than this means some size attribute was not made tiny."""
NUM_TOKENS = 13


# ---------------------------------------------------------------------------------------
# Discovery.

MODELS_DIR = os.path.dirname(transformers.models.__file__)
DECORATED = re.compile(r"^@use_experts_implementation\b.*\n(?:@.*\n)*class (\w+)\(", re.M)


def _modeling_files():
    """(module name, source) of every modeling file that names the decorator."""
    for family in sorted(os.listdir(MODELS_DIR)):
        folder = os.path.join(MODELS_DIR, family)
        if not os.path.isdir(folder):
            continue
        for file in sorted(os.listdir(folder)):
            if file.startswith("modeling_") and file.endswith(".py"):
                with open(os.path.join(folder, file), encoding="utf-8") as f:
                    text = f.read()
                if "@use_experts_implementation" in text:
                    yield f"transformers.models.{family}.{file[:-3]}", text


def _is_decorated(obj, module_name: str) -> bool:
    """A class of that module whose forward is the decorator's dispatching wrapper."""
    return (inspect.isclass(obj) and obj.__module__ == module_name and issubclass(obj, nn.Module)
            and inspect.getfile(obj.forward) == inspect.getfile(hf_moe))


def experts_classes() -> list[type]:
    """Every ``@use_experts_implementation`` class of the installed transformers."""
    found = []
    for name, _ in _modeling_files():
        module = importlib.import_module(name)
        found += [obj for obj in vars(module).values() if _is_decorated(obj, name)]
    return found


CLASSES = experts_classes()


def test_discovery_finds_every_decorated_class():
    """The classes found by their forward are exactly those the source decorates."""
    in_text = sorted(name for _, text in _modeling_files() for name in DECORATED.findall(text))
    assert CLASSES and sorted(cls.__name__ for cls in CLASSES) == in_text


# ---------------------------------------------------------------------------------------
# A tiny module of each class.


class NotConstructible(Exception):
    """No config class of the family gives a tiny instance of the experts class."""


def _config_candidates(cls: type) -> list[type]:
    """The config classes the modeling module knows, the one ``__init__`` annotates first."""
    module = importlib.import_module(cls.__module__)
    annotated = inspect.signature(cls.__init__.__wrapped__).parameters["config"].annotation
    if isinstance(annotated, str):
        annotated = getattr(module, annotated, None)
    configs = [v for v in vars(module).values()
               if inspect.isclass(v) and issubclass(v, transformers.PreTrainedConfig)
               and v is not transformers.PreTrainedConfig]
    return sorted(configs, key=lambda c: (c is not annotated, "Text" not in c.__name__, c.__name__))


def _tiny_config(config_cls: type):
    """The family's default config (its text config where it nests one), made tiny."""
    config = config_cls().get_text_config()
    for name, value in TINY.items():
        if hasattr(config, name):
            current = getattr(config, name)
            setattr(config, name, [value] * len(current) if isinstance(current, (list, tuple)) else value)
    return config


def build_tiny(cls: type) -> nn.Module:
    """``cls`` at hidden size 32, intermediate 16 and 8 experts, float32, every parameter
    N(0, 0.1); raises :class:`NotConstructible` naming what each config class gave."""
    extra = {name: TINY[name] for name in inspect.signature(cls.__init__.__wrapped__).parameters
             if name in TINY}  # e.g. Ernie 4.5 VL's per-modality intermediate_size
    failures = []
    for config_cls in _config_candidates(cls):
        try:
            config = _tiny_config(config_cls)
            with torch.device("meta"):
                shapes = {n: p.numel() for n, p in cls(config, **extra).named_parameters()}
            big = [n for n, numel in shapes.items() if numel > MAX_NUMEL]
            if big:
                failures.append(f"{config_cls.__name__}: {big} not tiny")
                continue
            module = cls(config, **extra)
        except Exception as err:  # noqa: BLE001 - every reason is reported
            failures.append(f"{config_cls.__name__}: {type(err).__name__}: {err}"[:300])
            continue
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in module.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        return module.float()
    raise NotConstructible("; ".join(failures) or "no config class in its modeling module")


# ---------------------------------------------------------------------------------------
# Each class: matched, refused or not constructible.


def _inputs():
    ids, weights = routing(NUM_TOKENS)  # expert 5 gets no token
    return ids, torch.randn(NUM_TOKENS, H, generator=torch.Generator().manual_seed(7)), weights


def compare(module: nn.Module, backend: str) -> dict:
    """{name: max abs difference} where ep_moe on ``backend`` differs from eager (empty
    when it matches)."""
    ep_hf.expert_parallel(nn.ModuleList([module]), None, backend=backend)
    ids, x, weights = _inputs()
    routed = Routed(module, ids)
    expected = forward_backward(routed, "eager", x, weights)
    actual = forward_backward(routed, ep_hf.IMPLEMENTATION, x, weights)
    assert expected["output"].abs().max() > 0 and expected["input.1"].abs().max() > 0
    return mismatches(actual, expected)


@functools.cache
def outcome(cls: type) -> tuple[str, str]:
    """("matched", ""), ("refused", reason), ("not constructible", reason), or
    ("MISMATCH", what differs) for a class ep_moe neither refuses nor computes exactly."""
    try:
        module = build_tiny(cls)
    except NotConstructible as err:
        return "not constructible", str(err)
    reason = ep_hf.unsupported_reason(module)
    if reason is not None:
        ids, x, weights = _inputs()
        module.config._experts_implementation = ep_hf.IMPLEMENTATION
        try:
            module(x, ids, weights)
        except NotImplementedError as err:
            if reason in str(err) and "'grouped_mm'" in str(err):
                return "refused", reason
            return "MISMATCH", f"refused, but the error does not name the reason and grouped_mm: {err}"
        return "MISMATCH", f"unsupported_reason says {reason!r}, yet the call ran"
    try:
        differs = compare(module, "torch")
    except Exception as err:  # noqa: BLE001 - a crash is a mismatch, reported as such
        return "MISMATCH", f"raised {type(err).__name__}: {err}"
    return ("MISMATCH", f"differs from eager (max abs diff): {differs}") if differs else ("matched", "")


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_experts_class_matches_eager_or_is_refused(cls):
    """ep_moe gives eager's output and every gradient, or refuses the class naming why;
    never another result."""
    kind, detail = outcome(cls)
    if kind == "not constructible":
        pytest.skip(f"not constructible: {detail}")
    assert kind in ("matched", "refused"), f"{cls.__module__}.{cls.__name__}: {detail}"


def _kind(cls: type):
    """What the Triton path sees of a class: layout flags, the fused activation or the
    torch gate it runs between the GEMMs, and the activation module's type."""
    try:
        module = build_tiny(cls)
    except NotConstructible:
        return None
    if ep_hf.unsupported_reason(module) is not None:
        return None
    activation = ep_hf.HFExperts(module, K, E, None, ep_hf.ExpertsOptions()).activation
    gate = activation if isinstance(activation, str) else getattr(activation, "__qualname__", "act_fn")
    flags = tuple(getattr(module, f) for f in ("has_gate", "has_bias", "is_transposed", "is_concatenated"))
    return flags + (gate.replace(cls.__name__, "<own>"), type(getattr(module, "act_fn", None)).__name__)


def _one_class_per_kind() -> list[type]:
    firsts = {}
    for cls in CLASSES:
        kind = _kind(cls)
        if kind is not None and kind not in firsts:
            firsts[kind] = cls
    return list(firsts.values())


TRITON_CLASSES = _one_class_per_kind()


@pytest.mark.parametrize("cls", TRITON_CLASSES, ids=lambda c: c.__name__)
def test_one_class_of_each_kind_matches_eager_on_triton(cls):
    """The Triton kernels (interpreter) on each kind of layout and gate: eager's output and
    every gradient."""
    differs = compare(build_tiny(cls), "triton")
    assert not differs, f"{cls.__name__} on Triton differs from eager: {differs}"


def test_sweep_counts_are_the_observed_ones():
    """How many classes match, are refused (and which, why) and cannot be built, as observed
    with transformers :data:`RECORDED_WITH` (skipped on another version); prints the table
    (``pytest -s``) on any."""
    outcomes = {cls: outcome(cls) for cls in CLASSES}
    lines = [f"{kind:18} {cls.__module__.split('.')[2]:24} {cls.__name__:34} {detail}"
             for cls, (kind, detail) in sorted(outcomes.items(), key=lambda item: (item[1][0], item[0].__name__))]
    counts = {kind: sum(k == kind for k, _ in outcomes.values()) for kind in ("matched", "refused",
                                                                            "not constructible", "MISMATCH")}
    print(f"\ntransformers {transformers.__version__}: {counts}; on Triton: "
          f"{[cls.__name__ for cls in TRITON_CLASSES]}\n" + "\n".join(lines))
    table = "\n".join(lines)
    installed = transformers.__version__
    if installed != RECORDED_WITH:
        pytest.skip(f"counts recorded with transformers {RECORDED_WITH}, installed {installed} ({len(CLASSES)} "
                    f"classes: {counts}): re-record EXPECTED_COUNTS, EXPECTED_REFUSED, EXPECTED_NOT_CONSTRUCTIBLE "
                    f"and RECORDED_WITH on {installed} (pytest -s prints the table)")
    assert counts == {**EXPECTED_COUNTS, "MISMATCH": 0}, table
    refused = {cls.__name__: detail for cls, (kind, detail) in outcomes.items() if kind == "refused"}
    assert refused.keys() == EXPECTED_REFUSED.keys(), table
    assert all(word in refused[name] for name, word in EXPECTED_REFUSED.items()), table
    not_built = {cls.__name__ for cls, (kind, _) in outcomes.items() if kind == "not constructible"}
    assert not_built == EXPECTED_NOT_CONSTRUCTIBLE.keys(), table
