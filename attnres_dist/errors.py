"""User-facing errors: one line naming the field (or input), the bad value, and the fix.

The command line catches these, prints ``error: <message>`` and exits with code 2, before any
process group starts. ``TrainingHalted`` stops a run that is already training (exit code 3).
Everything else is a bug and keeps its traceback.
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


class TrainingHalted(RuntimeError):
    """A condition that stops a run mid-training; the command line exits with code 3."""

    exit_code = 3

    def __init__(self, where: str, message: str):
        self.where = where
        super().__init__(f"{where}: {message}")
