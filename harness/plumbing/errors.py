"""What the user got wrong, told apart from what the harness got wrong.

`kokoro-parity` prints a `UsageError` as one line that names the file, field or option, and exits 2.
Any other exception is a defect of the harness or of a runtime: it keeps its traceback, so an
internal ValueError or KeyError is never read as bad input."""
from __future__ import annotations


class UsageError(ValueError):
    """Bad input: a file, a field, an option, an environment variable. A ValueError, so the callers
    that catch those (the plugin's option checks, pydantic's validators) still do."""


class UnknownName(UsageError, KeyError):
    """A name that is not in its table (a step, a backend, a patch, a Kokoro tensor): a KeyError too,
    for callers that look names up; printed without KeyError's quotes."""

    __str__ = BaseException.__str__
