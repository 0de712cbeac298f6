"""User-facing errors: one line naming the field (or input), the bad value, and the fix.

The command line catches these, prints ``error: <message>`` and exits with code 2, before any
process group starts. Everything else is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """A mistake in the user's input (config, data, checkpoint, launch) with a one-line fix."""

    exit_code = 2

    def __init__(self, where: str, message: str):
        self.where = where
        super().__init__(f"{where}: {message}")


class ConfigError(UserError):
    """An invalid configuration field."""


class DataError(UserError):
    """A missing, empty or inconsistent dataset."""
