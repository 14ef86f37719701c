"""Typed errors that the CLI boundary turns into one red line and an exit code.

Exit codes (the table lives here and in docs/design.md):
  0 ok · 1 SparkError (other) · 2 usage: a flag the parser or a command refuses (UsageError,
  click's own usage errors) · 3 ModelFileError · 4 PlanError · 5 ProfileError (corpus,
  profile, trace) · 6 NativeError · 7 DeviceError · 8 DownloadError · 130 interrupted
OutputError (a refused output path) is a usage error (2); SaveError, LockTimeout, DeviceLostError
(a device or RPC server lost mid-run) and BundledDataError (a malformed table in spark_cli/data) exit 1. EXIT_CODES lists the types with a code of their own.
"""

from __future__ import annotations


class SparkError(Exception):
    """An error a user can act on: `message` names the file or flag, `hint` what to do."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None, exit_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code

    def one_line(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class UsageError(SparkError):
    """A flag value a command refuses (the same exit code as the parser's usage errors)."""

    exit_code = 2


class ModelFileError(SparkError):
    """A model path that is missing, truncated, not GGUF, or has no experts."""

    exit_code = 3


class PlanError(SparkError):
    """A budget that cannot hold the placement, or a plan for another model."""

    exit_code = 4


class ProfileError(SparkError):
    """A profile, trace or corpus that is unreadable or belongs to another model."""

    exit_code = 5


class NativeError(SparkError):
    """The patched llama.cpp refused a configuration, is missing, or is of another API version."""

    exit_code = 6


class DeviceError(SparkError):
    """A device (-dev, --rpc) that does not exist, answer, or report its memory."""

    exit_code = 7


class DownloadError(SparkError):
    """A failed download or checksum."""

    exit_code = 8


class OutputError(SparkError):
    """An output path Spark must not write: a device, a FIFO, a folder, a missing folder (a usage error)."""

    exit_code = 2


class SaveError(SparkError):
    """A save that failed after the work was done; the message names where the data went."""

    exit_code = 1


class LockTimeout(SparkError):
    """Another process held a lock for longer than Spark waits."""

    exit_code = 1


class DeviceLostError(SparkError):
    """The device or RPC server went away during a run (faults.keeper's abort path exits 1)."""

    exit_code = 1


class BundledDataError(SparkError, ValueError):
    """A table shipped with Spark (spark_cli/data/*.toml) is malformed: a damaged or hand-edited install."""

    def __init__(self, message: str):
        super().__init__(message, hint="reinstall Spark, or undo the edit to the bundled table")


class InternalError(SparkError):
    """llama.cpp aborted on its own (an assertion), not because a device or server was lost."""

    exit_code = 1


EXIT_CODES: dict[str, int] = {c.__name__: c.exit_code for c in
                              (SparkError, UsageError, ModelFileError, PlanError, ProfileError, NativeError,
                               DeviceError, DownloadError)}
