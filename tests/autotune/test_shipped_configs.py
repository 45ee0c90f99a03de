"""The tuned configs shipped in ep_moe/autotune/shipped/: every file parses under the current
schema, sits in its device's directory under its key's file name, serves lookups, and is in
the wheel; the wheel, installed by pip (not editable), serves them and runs ``ep-moe``."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ep_moe.autotune.cache import SHIPPED_DIR, CacheKey, device_dir_name, load_shipped, parse_record, read_file
from ep_moe.kernels.config import PASSES
from ep_moe.kernels.grouped_gemm import KERNEL_VERSION

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(SHIPPED_DIR.glob("*/*.json"))
DEVICES = {"NVIDIA_H200"}
# The four benchmark shapes at E, E/2 and E/4 local experts, two projections each.
PER_DEVICE = 24


def test_each_device_ships_every_shape():
    by_device = {}
    for path in SHIPPED:
        by_device.setdefault(path.parent.name, []).append(path)
    assert set(by_device) == DEVICES
    for device in DEVICES:
        assert len(by_device[device]) == PER_DEVICE


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name[:40]}")
def test_shipped_file_is_valid_and_served(path: Path):
    data, why = read_file(path)
    assert why is None, why
    key = CacheKey.from_dict(data["key"])
    table = parse_record(data, key)
    assert key.kernel_version == KERNEL_VERSION, "retune the shipped configs after a kernel change"
    assert path.parent.name == device_dir_name(key.device_name) and path.name == key.file_name()
    assert table and all(entry.configs.for_pass(p) is not None for entry in table.values() for p in PASSES)
    assert load_shipped(key) == table


def _build_wheel(tmp: Path) -> Path:
    """A wheel of a copy of the package (the shared tree gets no build/ directory)."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src)
    shutil.copytree(REPO / "ep_moe", src / "ep_moe", ignore=shutil.ignore_patterns("__pycache__"))
    code = f"from setuptools import build_meta; print(build_meta.build_wheel({str(tmp / 'dist')!r}))"
    run = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return tmp / "dist" / run.stdout.strip().splitlines()[-1]


# Run from the installed wheel: the package is the installed copy, finds its shipped files and serves one.
_INSTALLED_CHECK = """
import json, sys
import importlib.resources
import ep_moe
from ep_moe import cli
from ep_moe.autotune.cache import CacheKey, load_shipped, read_file
assert ep_moe.__file__.startswith(sys.argv[1]), ep_moe.__file__
shipped = importlib.resources.files("ep_moe.autotune") / "shipped"
files = sorted(p for d in shipped.iterdir() if d.is_dir() for p in d.iterdir() if p.name.endswith(".json"))
data, why = read_file(files[0])
assert why is None, why
print(json.dumps({"files": len(files), "served": load_shipped(CacheKey.from_dict(data["key"])) is not None}))
"""


def test_the_installed_wheel_serves_the_shipped_configs_and_runs_the_cli(tmp_path):
    """CI's packaging check: build the wheel, ``pip install`` it (not editable, no
    dependencies: this venv's torch and triton serve) into its own directory, and from there
    serve a shipped config and run the ``ep-moe`` console script pip wrote. The repository
    is off ``sys.path`` (another working directory), and ``PYTHONPATH`` puts the installed
    copy before this venv's editable one."""
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    in_wheel = {n.removeprefix("ep_moe/autotune/shipped/") for n in names if n.startswith("ep_moe/autotune/shipped/")}
    assert {str(p.relative_to(SHIPPED_DIR)) for p in SHIPPED} <= in_wheel
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                              "--disable-pip-version-check", "--target", str(site), str(wheel)],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k != "EP_MOE_SHIPPED_DIR"}
    env["PYTHONPATH"] = str(site)
    run = subprocess.run([sys.executable, "-c", _INSTALLED_CHECK, str(site)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.splitlines()[-1]) == {"files": len(SHIPPED), "served": True}
    script = site / "bin" / "ep-moe"
    assert script.is_file(), f"pip wrote no ep-moe console script: {sorted(p.name for p in site.iterdir())}"
    help_run = subprocess.run([str(script), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
    assert help_run.returncode == 0 and "autotune" in help_run.stdout, help_run.stderr[-3000:]
