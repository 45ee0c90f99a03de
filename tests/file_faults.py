"""Ways to damage a file on disk, for the tests of what reads checkpoints and caches back:
each takes the file's path and leaves it in that state."""

from __future__ import annotations

from pathlib import Path


def truncate(path: Path) -> None:
    """The first half of the file's bytes kept (a write cut short)."""
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def garbage(path: Path) -> None:
    """Bytes of no format in place of the file's."""
    path.write_bytes(bytes(range(256)) * 8)


def empty(path: Path) -> None:
    """Zero bytes."""
    path.write_bytes(b"")


def delete(path: Path) -> None:
    """The file gone."""
    path.unlink()
