"""The error a command ends with when its input or its surroundings are wrong, not the code.

Whatever finds the problem (a setting's validator, the kubeconfig loader, a bind that the
host refuses) raises :class:`StartupError` with one sentence that names the setting by its
flag and environment variable and says what to do. ``dra_driver.cli.main`` is the one place
that turns it into the single line a user sees: ``error: ...`` on a terminal, one JSON log
event in a pod, where a traceback would also break the log's one-event-per-line format.
"""

from __future__ import annotations

EXIT_USAGE = 2  # a flag, an env var or a command line is wrong: fix the invocation
EXIT_FAILURE = 1  # the invocation is fine, the host or the cluster refuses it


class StartupError(Exception):
    """A problem the user has to fix before the command can run; the message says how."""

    def __init__(self, message: str, *, exit_code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.exit_code = exit_code
