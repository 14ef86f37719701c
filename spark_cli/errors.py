"""Typed errors that the CLI boundary turns into one red line and an exit code."""

from __future__ import annotations


class SparkError(Exception):
    """An error a user can act on: `message` names the file or flag, `hint` what to do."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None, exit_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code

    def one_line(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class ModelFileError(SparkError):
    """A model path that is missing, truncated, not GGUF, or has no experts."""


class DownloadError(SparkError):
    """A failed download or checksum."""


class NativeError(SparkError):
    """The patched llama.cpp refused a configuration or is missing."""


class PlanError(SparkError):
    """A budget that cannot hold the placement, or a plan for another model."""


class ProfileError(SparkError):
    """A profile or trace that is unreadable or belongs to another model."""


class OutputError(SparkError):
    """An output path Spark must not write: a device, a FIFO, a folder, a missing folder."""


class SaveError(SparkError):
    """A save that failed after the work was done; the message names where the data went."""

    exit_code = 1


class LockTimeout(SparkError):
    """Another process held a lock for longer than Spark waits."""

    exit_code = 1


class DeviceLostError(SparkError):
    """The device or RPC server went away during a run."""

    exit_code = 1
