"""The error of the run folder and its files: one a user can act on, its message says how."""

from __future__ import annotations


class RunError(RuntimeError):
    """A problem with the run folder or its files that the user can act on (the message says how)."""
