"""The tuned configs shipped in configs/kernels/: every file parses under the current
schema, sits in its device's directory under its key's file name, and serves lookups."""

from pathlib import Path

import pytest

from ep_moe.autotune.cache import CONFIGS_DIR, CacheKey, device_dir_name, load_shipped, parse_record, read_file
from ep_moe.kernels.config import PASSES
from ep_moe.kernels.grouped_gemm import KERNEL_VERSION

SHIPPED = sorted((CONFIGS_DIR / "kernels").glob("*/*.json"))
DEVICES = {"NVIDIA_H100_80GB_HBM3", "NVIDIA_H200"}
# The four ANCHORS.md shapes at E, E/2 and E/4 local experts, two projections each.
PER_DEVICE = 24


def test_both_devices_ship_every_shape():
    by_device = {}
    for path in SHIPPED:
        by_device.setdefault(path.parent.name, []).append(path)
    assert DEVICES <= set(by_device)
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
