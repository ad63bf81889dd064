"""loader/errors.py: ServingError.within names where an error happened without changing it for its other callers."""

from __future__ import annotations

from servex.loader.errors import InvalidArgument, ServingError, error_with_code


class WithStatus(ServingError):
    """A subclass whose __init__ takes more than the message."""

    def __init__(self, message: str, code: str, status: int):
        super().__init__(message)
        self.code, self.status = code, status


def test_within_prefixes_a_copy_of_the_same_kind():
    error = InvalidArgument("running 'x:0' failed: Incompatible shapes")
    named = error.within("model 'm' version 1 signature 'serving_default'")
    assert type(named) is InvalidArgument and named.code == "INVALID_ARGUMENT"
    assert named.message == "model 'm' version 1 signature 'serving_default': running 'x:0' failed: Incompatible shapes"
    assert str(named) == named.message
    assert error.message == "running 'x:0' failed: Incompatible shapes"  # one error may reach several callers


def test_within_keeps_what_a_subclass_or_a_code_by_number_carries():
    named = WithStatus("gone", "NOT_FOUND", 404).within("model 'm'")
    assert (type(named), named.code, named.status, named.message) == (WithStatus, "NOT_FOUND", 404, "model 'm': gone")
    by_number = error_with_code(4, "deadline").within("model 'm'")
    assert by_number.code == "DEADLINE_EXCEEDED" and by_number.message == "model 'm': deadline"
