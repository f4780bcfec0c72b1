"""User-facing errors.

Anything a user can get wrong (a missing file, a corrupt checkpoint, a bad flag value)
raises `JaxdecError` with one line that names the problem. The CLI prints that line and
exits non-zero; library callers catch it like any exception.
"""


class JaxdecError(Exception):
    """A problem with the user's input, reported in one line."""


class ModelNotInstalled(JaxdecError):
    """A named model whose files are not on this machine yet."""
