"""kvshade: Python client of the kvshade KV-cache daemon (ctypes over libkvshade.so).

    import kvshade
    with kvshade.Client("127.0.0.1:50551") as c:
        s = c.create_session(kvshade.ModelSpec("m", 32, 32, 8, 128), kvshade.Profile("shadow"), ids)

numpy is required; torch is optional (kvshade.decoders.local, kvshade.decoders.remote,
kvshade.integrations and kvshade.testing need it). kvshade.Decoder is the protocol the
decoders follow (kvshade.decoders.base).
"""
from .client import (AttachmentInfo, AttendFuture, Client, CreatedSession, Ingest, ModelSpec, Profile,
                     SelectFuture, SlotDelta, StaticSet, TensorParallel, bf16_bits_to_f32, f32_to_bf16_bits,
                     rows_to_torch, to_wire)
from .decoders.base import Decoder
from .routing import Placement
from .errors import (Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded, FailedPrecondition,
                     Internal, InvalidArgument, KvShadeError, NotFound, OutOfRange, PermissionDenied,
                     ResourceExhausted, Unauthenticated, Unavailable, Unimplemented, Unknown)

__all__ = [
    "AttachmentInfo", "AttendFuture", "Client", "CreatedSession", "Ingest", "ModelSpec", "Profile", "SelectFuture",
    "SlotDelta", "StaticSet", "TensorParallel", "bf16_bits_to_f32", "f32_to_bf16_bits", "rows_to_torch", "to_wire", "Decoder", "Placement",
    "Aborted", "AlreadyExists", "Cancelled", "DataLoss", "DeadlineExceeded", "FailedPrecondition", "Internal",
    "InvalidArgument", "KvShadeError", "NotFound", "OutOfRange", "PermissionDenied", "ResourceExhausted",
    "Unauthenticated", "Unavailable", "Unimplemented", "Unknown", "library_path",
]
__version__ = "0.1.0"


def library_path() -> str:
    """Path of the loaded libkvshade.so."""
    from . import _native
    return _native.lib()._kvshade_path
