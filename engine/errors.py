"""Errors raised by the engine. Each carries a `code` the gRPC layer maps to a status."""


class BraidError(ValueError):
    code = "INVALID_ARGUMENT"


class UnknownMessageError(BraidError, KeyError):
    code = "NOT_FOUND"

    def __str__(self):  # KeyError would quote the message
        return self.args[0] if self.args else ""


class FingerprintMismatchError(BraidError):
    code = "FAILED_PRECONDITION"


class InvalidOffsetError(BraidError):
    code = "INVALID_ARGUMENT"


class EmptyHeaderError(BraidError):
    code = "INVALID_ARGUMENT"


class ContextOverflowError(BraidError):
    code = "OUT_OF_RANGE"


class StoreFullError(BraidError):
    code = "RESOURCE_EXHAUSTED"


class MessageInUseError(BraidError):
    code = "FAILED_PRECONDITION"


class PreconditionError(BraidError):
    """The request is valid, but the deployment or the server's state cannot serve it as asked."""
    code = "FAILED_PRECONDITION"


class UnavailableError(BraidError):
    """What the request needs stopped coming (a stalled or failed source); retrying may succeed."""
    code = "UNAVAILABLE"


class DataLossError(BraidError):
    """A message's KV is gone (the replica that held it went away, or evicted it) and its record cannot give it
    again: what shaped it was not recorded, or the weights changed. Retrying cannot help; encode it again."""
    code = "DATA_LOSS"


class StoppedError(BraidError):
    """The request's consumer went away, so its work was stopped."""
    code = "CANCELLED"


class StepFailedError(BraidError):
    """The engine's step failed outside any one request's forward; the requests it held fail with it."""
    code = "INTERNAL"
