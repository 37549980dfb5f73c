"""Exceptions of the kvshade package: one class per status code of the C ABI (the gRPC codes).

Every error is a KvShadeError with `.code` (int) and `.code_name` ("NOT_FOUND", ...);
InvalidArgument is also a ValueError, NotFound a LookupError, DeadlineExceeded a
TimeoutError, so generic handlers work too.
"""
from typing import Dict, Optional, Type


class KvShadeError(Exception):
    code = 2
    code_name = "UNKNOWN"

    def __init__(self, message: str, code: Optional[int] = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class Cancelled(KvShadeError):
    code, code_name = 1, "CANCELLED"


class Unknown(KvShadeError):
    code, code_name = 2, "UNKNOWN"


class InvalidArgument(KvShadeError, ValueError):
    code, code_name = 3, "INVALID_ARGUMENT"


class DeadlineExceeded(KvShadeError, TimeoutError):
    code, code_name = 4, "DEADLINE_EXCEEDED"


class NotFound(KvShadeError, LookupError):
    code, code_name = 5, "NOT_FOUND"


class AlreadyExists(KvShadeError):
    code, code_name = 6, "ALREADY_EXISTS"


class PermissionDenied(KvShadeError):
    code, code_name = 7, "PERMISSION_DENIED"


class ResourceExhausted(KvShadeError):
    code, code_name = 8, "RESOURCE_EXHAUSTED"


class FailedPrecondition(KvShadeError):
    code, code_name = 9, "FAILED_PRECONDITION"


class Aborted(KvShadeError):
    code, code_name = 10, "ABORTED"


class OutOfRange(KvShadeError):
    code, code_name = 11, "OUT_OF_RANGE"


class Unimplemented(KvShadeError):
    code, code_name = 12, "UNIMPLEMENTED"


class Internal(KvShadeError):
    code, code_name = 13, "INTERNAL"


class Unavailable(KvShadeError):
    code, code_name = 14, "UNAVAILABLE"


class DataLoss(KvShadeError):
    code, code_name = 15, "DATA_LOSS"


class Unauthenticated(KvShadeError):
    code, code_name = 16, "UNAUTHENTICATED"


BY_CODE: Dict[int, Type[KvShadeError]] = {cls.code: cls for cls in (
    Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
    PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange,
    Unimplemented, Internal, Unavailable, DataLoss, Unauthenticated)}


def from_code(code: int, message: str) -> KvShadeError:
    """The exception of a C ABI status code (KvShadeError itself for a code without a class)."""
    cls = BY_CODE.get(code)
    if cls is None:
        return KvShadeError(message, code=code)
    return cls(message)
