"""Error types raised by moerunner.

Every check of user input raises one of these (or a plain ``TypeError`` for a wrong type),
with a message that names the argument, what was given and what is accepted. They subclass
``ValueError`` so callers that already catch ``ValueError`` keep working.
"""

from __future__ import annotations


class MoeInputError(ValueError):
    """An argument has the wrong shape, value or combination with other arguments."""


class BackendUnavailableError(ValueError):
    """No registered backend can serve a request; the message lists each and why not."""


class ExtensionContractError(TypeError):
    """A registered backend or dispatcher (an extension) does not keep its contract
    (``moerunner.backends.base``, ``moerunner.dispatch.base``): the message names it, what it
    declared or returned, and what is expected."""


class CapacityOverflowError(RuntimeError):
    """A fixed-capacity (masked) layout received more tokens for an expert than it holds."""


class RankFailedError(RuntimeError):
    """A step of a process group failed on some ranks; raised on every rank alike.

    ``ranks``: the ranks that failed; ``errors``: each one's ``"Type: message"``. On a rank
    that failed, the local exception is the ``__cause__``.
    """

    def __init__(self, message: str, ranks: tuple[int, ...] = (), errors: tuple[str, ...] = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.errors = tuple(errors)
