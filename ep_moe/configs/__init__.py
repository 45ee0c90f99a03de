"""The presets that ship with the package: model shapes (``models/*.json``, for
``ep-moe autotune --model`` and :func:`ep_moe.autotune.cache.load_model_shape`) and training
configs (``train/*.toml``, for the trainer's ``--config``).

They are package data (``pyproject.toml``'s ``[tool.setuptools.package-data]``), found
through :mod:`importlib.resources`: the same files from a checkout, an editable install and
an installed wheel. :func:`resolve_preset` is the one lookup every reader uses: a path to an
existing file is taken as is, else the name of a preset (the file name without its suffix).
Imports nothing of ep_moe.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

SUFFIXES = {"models": ".json", "train": ".toml"}
"""Each kind of preset: its folder here and its files' suffix."""


def preset_dir(kind: str) -> Path:
    """The folder of one kind of preset (``"models"`` or ``"train"``)."""
    if kind not in SUFFIXES:
        raise ValueError(f"preset kind {kind!r}: expected one of {', '.join(SUFFIXES)}")
    root = resources.files(__name__)
    if not isinstance(root, Path):  # a zip import: the readers open presets as files
        raise RuntimeError(f"ep_moe's presets are read as files, but the package is not on a file system: {root}")
    return root / kind


def preset_names(kind: str) -> list[str]:
    """The names of one kind's presets, sorted."""
    return sorted(p.stem for p in preset_dir(kind).glob(f"*{SUFFIXES[kind]}") if p.is_file())


def resolve_preset(kind: str, name_or_file: str | Path, what: str) -> Path:
    """The file ``name_or_file`` names: an existing file's path as given, else the preset
    of that name. Raises ``ValueError`` starting with ``what`` (e.g. ``"--config x"``) and
    listing the presets when it is neither."""
    path = Path(name_or_file).expanduser()
    if path.is_file():
        return path
    name = str(name_or_file)
    if name in preset_names(kind):
        return preset_dir(kind) / f"{name}{SUFFIXES[kind]}"
    raise ValueError(f"{what}: no such file and no preset of that name; "
                     f"presets: {', '.join(preset_names(kind)) or 'none found'}")
