"""Exceptions raised by mtpkern.

Every public call validates its arguments at the boundary. Plain argument
mistakes raise ``ValueError`` / ``TypeError``; the classes below mark the
failures an engine may want to catch separately. All of them derive from
``MtpError`` and, where the cause is a bad value, also from ``ValueError``.
"""

from __future__ import annotations


class MtpError(Exception):
    """Base class of every mtpkern-specific error."""


class ConfigError(MtpError, ValueError):
    """A config.json field is missing, of the wrong type, or inconsistent."""


class CheckpointError(MtpError, ValueError):
    """A checkpoint tensor is missing, mis-shaped, of the wrong dtype, or unreadable."""


class BackendUnavailable(MtpError, RuntimeError):
    """The backend asked for cannot run here (e.g. ``cuda`` without CuPy or without a device).

    The message says what is missing and, for a missing package, which extra installs it."""


def install_hint(extra: str) -> str:
    """How to install the extra ``extra``, in both forms: from a wheel (PyPI) and from a
    source checkout (where ``mtpkern[extra]`` would look the package up on PyPI instead)."""
    return f"pip install 'mtpkern[{extra}]' (from a source checkout: pip install -e '.[{extra}]')"


class MissingExtra(MtpError, ImportError):
    """An optional feature needs a package that is not installed; ``extra`` names the
    extra that brings it (``install_hint(extra)``)."""

    def __init__(self, message: str, extra: str):
        super().__init__(message)
        self.extra = extra


class KvCacheFull(MtpError):
    """A module's KV block pool cannot hold the rows a call needs.

    Raised before anything is written: the call changed nothing.
    """

    def __init__(self, module: int, needed: int, available: int, num_blocks: int):
        self.module = module
        self.needed = needed
        self.available = available
        self.num_blocks = num_blocks
        super().__init__(
            f"KV pool of module {module} is full: the call needs {needed} more block(s), "
            f"{available} of {num_blocks} are available; free finished sequences, "
            f"or build the proposer with a larger num_blocks"
        )


class StateError(MtpError, ValueError):
    """A proposer state used out of protocol: freed, foreign, or in the wrong phase."""


class NoAllowedToken(MtpError, ValueError):
    """No token can be drafted for some row: the grammar bitmask allows none with a
    non-NaN logit (or, without a mask, every logit is NaN). ``row``: that row of the
    op's input (the sequence's index in a propose batch); ``draft``: the draft
    position, where the proposer knows it."""

    def __init__(self, message: str, row: int | None = None, draft: int | None = None):
        super().__init__(message)
        self.row = row
        self.draft = draft


def no_token_where(i: int | None, batch: int, m: int) -> str:
    """Where a propose found no token: the draft position, and the sequence in a batch."""
    if batch == 1 or i is None:
        return f"draft position {m}"
    return f"draft position {m} of sequence {i} (states[{i}])"


def no_token_reason(masked: bool, V: int) -> str:
    """Why a row has no token to draft (the message of ``NoAllowedToken``)."""
    if masked:
        return f"the grammar bitmask allows no token with a non-NaN logit (vocabulary of {V})"
    return f"every logit is NaN (vocabulary of {V}; a NaN or Inf in the hidden it was drafted from?)"
