"""What a wheel carries besides the code: every data file under ``ep_moe/`` is declared in
``pyproject.toml``'s package data (else a wheel, and so an installed trainer or ``ep-moe
autotune``, goes without it), and the presets resolve by name through
``ep_moe.configs.resolve_preset``, the one lookup every reader uses. Builds nothing:
``.ci/wheel_check.sh`` installs a real wheel."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest

from ep_moe.configs import SUFFIXES, preset_dir, preset_names, resolve_preset

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]


def _package_data() -> dict[str, list[str]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return project["tool"]["setuptools"]["package-data"]


def test_every_data_file_of_the_package_is_declared():
    """Each file under ``ep_moe/`` that is not Python matches a package-data glob of a
    package above it (globbed as setuptools does, from the package's folder)."""
    declared = set()
    for package, patterns in _package_data().items():
        root = REPO / package.replace(".", "/")
        for pattern in patterns:
            matched = {root / name for name in glob.glob(pattern, root_dir=root)}
            assert matched, f"package-data {package!r}: {pattern!r} matches no file under {root}"
            declared |= matched
    data = {p for p in (REPO / "ep_moe").rglob("*") if p.is_file() and "__pycache__" not in p.parts
            and p.suffix not in (".py", ".pyc") and not p.name.startswith(".")}
    missing = sorted(str(p.relative_to(REPO)) for p in data - declared)
    assert not missing, f"not in pyproject.toml's [tool.setuptools.package-data], so not in a wheel: {missing}"
    assert {p for p in declared if p.parent.parent == REPO / "ep_moe" / "configs"} == {
        p for kind in SUFFIXES for p in preset_dir(kind).iterdir() if p.is_file()}


@pytest.mark.parametrize("kind", sorted(SUFFIXES))
def test_every_preset_resolves_by_name(kind):
    names = preset_names(kind)
    assert "tiny" in names
    for name in names:
        path = resolve_preset(kind, name, f"preset {name}")
        assert path == preset_dir(kind) / f"{name}{SUFFIXES[kind]}" and path.is_file()
    assert resolve_preset(kind, str(path), "a path") == path


def test_the_documented_presets_are_there():
    assert {"tiny", "gpu", "hf", "qwen3_ep"} <= set(preset_names("train"))
    assert {"tiny", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3", "gpt-oss-20b"} <= set(preset_names("models"))


def test_an_unknown_name_lists_the_presets(tmp_path):
    with pytest.raises(ValueError, match=r"^model 'nope': no such file and no preset of that name; presets: "
                                         r"deepseek-v3, .*qwen3-30b-a3b, tiny$"):
        resolve_preset("models", "nope", "model 'nope'")
    with pytest.raises(ValueError, match="no such file"):
        resolve_preset("train", str(tmp_path), "--config DIR")  # a folder is no config file
    with pytest.raises(ValueError, match="preset kind"):
        preset_dir("kernels")
