"""Errors every layer raises, carrying a status code the protocol adapters translate.

The codes are the names of gRPC's status codes; `server/` maps them to ``grpc.StatusCode`` and to HTTP codes.
Keeping them here (the bottom layer) lets `loader/` and `executor/` raise them without importing gRPC.
"""

from __future__ import annotations


class ServingError(Exception):
    """An error a caller can act on: ``code`` says which kind, ``message`` says what and what was expected."""

    code = "INTERNAL"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def within(self, where: str) -> ServingError:
        """A copy of this error (same class and code) whose message starts with ``where``; a copy, since one
        error may reach several callers (a batched run's)."""
        error = self.__class__.__new__(self.__class__)  # not __init__: a subclass's may take other arguments
        error.__dict__.update(self.__dict__)
        error.message = f"{where}: {self.message}"
        error.args = (error.message,)
        return error


# gRPC's (and TensorFlow's) status codes by number.
CODE_NAMES = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)


def error_with_code(code: int, message: str) -> ServingError:
    """A ServingError carrying status ``code`` by number (e.g. a TensorFlow OpError's ``error_code``)."""
    error = ServingError(message)
    error.code = CODE_NAMES[code] if 0 < code < len(CODE_NAMES) else "UNKNOWN"
    return error


class InvalidArgument(ServingError):
    code = "INVALID_ARGUMENT"


class NotFound(ServingError):
    code = "NOT_FOUND"
    # The same error in TensorFlow Serving's words ("Servable not found for request: Latest(m); ..."), where the
    # model manager has them (an unknown model or version): TensorFlow Serving's gRPC and REST APIs answer these,
    # the other protocols ``message`` (Triton's words).
    tfserving = ""


class AlreadyExists(ServingError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(ServingError):
    code = "FAILED_PRECONDITION"


class PermissionDenied(ServingError):
    """The caller may not do this here (e.g. run a state-changing op by tensor name on the public port)."""

    code = "PERMISSION_DENIED"


class ResourceExhausted(ServingError):
    code = "RESOURCE_EXHAUSTED"


class Unimplemented(ServingError):
    code = "UNIMPLEMENTED"


class Unavailable(ServingError):
    code = "UNAVAILABLE"


class LoadError(ServingError):
    """A model version could not be loaded; the message names the path and what is wrong with it."""

    code = "FAILED_PRECONDITION"
