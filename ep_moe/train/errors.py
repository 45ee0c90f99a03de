"""Errors the user fixes: a config value, a data file, a checkpoint on disk.

The trainer's ``main`` (``ep_moe/train/train.py``) prints their message as one line (rank 0
only: each is raised alike on every rank, from the same config and files, before the process
group exists or after the ranks agreed) and exits with status 2, without a traceback. Any
other exception is a bug, or a failure of the run itself, and keeps its traceback. Each
message names the input and the fix.
"""


class UserError(Exception):
    """An error in the run's input."""


class ConfigError(UserError, ValueError):
    """A config file or command-line value that is unknown, of the wrong type or out of range;
    or an output path that cannot be written or is of the wrong kind, or a checkpoint
    directory that another trainer is using."""


class DataError(UserError, ValueError):
    """A data file that cannot be used: missing, empty or of the wrong size, or truncated
    while the run reads it."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be resumed from: missing, incomplete, damaged, or another model's."""
