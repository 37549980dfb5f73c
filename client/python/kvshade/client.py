"""The kvshade Python client: a thin, typed layer over the C ABI (libkvshade.so via ctypes).

Tensors go in as numpy arrays or torch tensors (any float dtype, host or device; they are
copied to host and converted to the model's wire dtype: bf16 with round-to-nearest-even,
fp16 or fp32) and come out as float32 numpy arrays. Errors raise the classes of
kvshade.errors, chosen by status code.
"""
import ctypes
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _native
from . import _native_abi as _abi
from .errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, from_code

# The values kvshade.h names (KVSHADE_*) come from it (_native_abi.py, generated).
DTYPES = {"bf16": _abi.KVSHADE_DTYPE_BF16, "bfloat16": _abi.KVSHADE_DTYPE_BF16,
          "fp16": _abi.KVSHADE_DTYPE_FP16, "float16": _abi.KVSHADE_DTYPE_FP16,
          "fp32": _abi.KVSHADE_DTYPE_FP32, "float32": _abi.KVSHADE_DTYPE_FP32}
PROFILES = {"auto": _abi.KVSHADE_PROFILE_AUTO, "shadow": _abi.KVSHADE_PROFILE_SHADOW,
            "mini": _abi.KVSHADE_PROFILE_MINI, "exact": _abi.KVSHADE_PROFILE_EXACT}
PROFILE_NAMES = {v: k for k, v in PROFILES.items()}
CODECS = {"default": 0, "bf16": 1, "fp8": 2, "int4": 3, "int2": 4}
RECALL_ACTIONS = {"default": 0, "report": _abi.KVSHADE_RECALL_REPORT, "widen": _abi.KVSHADE_RECALL_WIDEN,
                  "exact": _abi.KVSHADE_RECALL_EXACT}
# kvshade_layer_selection.fallback
FALLBACK_NAMES = {_abi.KVSHADE_RECALL_WIDEN: "widen", _abi.KVSHADE_RECALL_EXACT: "exact"}
SCALINGS = {"none": 0, "linear": 1, "llama3": 2, "yarn": 3}
PAIRINGS = {"half": 0, "neox": 0, "interleaved": 1, "gptj": 1}
DELIVERIES = {_abi.KVSHADE_DELIVERY_INLINE: "inline", _abi.KVSHADE_DELIVERY_UCX_RMA: "ucx_rma",
              _abi.KVSHADE_DELIVERY_CUDA_IPC: "cuda_ipc"}


def _check(rc):
    if rc != 0:
        msg = _native.lib().kvshade_last_error().decode("utf-8", "replace")
        raise from_code(rc, msg)


def _b(s):
    return None if s is None else s.encode("utf-8")


def _dtype_code(dtype):
    if isinstance(dtype, int):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise InvalidArgument("dtype must be one of bf16, fp16, fp32, got %r" % (dtype,))


def f32_to_bf16_bits(x: Any) -> "np.ndarray":
    """float32 array -> uint16 bf16 bits, round to nearest even (as the service does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    out = rounded.astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out


def bf16_bits_to_f32(bits: Any) -> "np.ndarray":
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_wire(x: Any, dtype: str) -> "np.ndarray":
    """numpy array or torch tensor -> contiguous numpy array in the wire dtype.

    For bf16, a uint16 numpy array (or a torch.bfloat16 tensor) is taken as raw bf16 bits."""
    code = _dtype_code(dtype)
    if type(x).__module__.startswith("torch"):
        import torch
        t = x.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            bits = t.view(torch.int16).numpy().view(np.uint16)
            x = bits if code == 1 else bf16_bits_to_f32(bits)
        else:
            x = t.float().numpy() if code != 2 else t.half().numpy()
    a = np.asarray(x)
    if code == 1:
        return np.ascontiguousarray(a) if a.dtype == np.uint16 else f32_to_bf16_bits(a)
    if code == 2:
        return np.ascontiguousarray(a, dtype=np.float16)
    if code == 3:
        return np.ascontiguousarray(a, dtype=np.float32)
    raise InvalidArgument("dtype must be one of bf16, fp16, fp32, got %r" % (dtype,))


_cuda_driver = None


def _driver():
    """The CUDA driver library (libcuda), loaded once."""
    global _cuda_driver
    if _cuda_driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                                ctypes.c_uint64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        _cuda_driver = lib
    return _cuda_driver


def _bind_primary_context(drv, index):
    """Makes device `index`'s primary context (the one torch and the CUDA runtime use) current
    on this thread when none is: a thread that has not run a CUDA runtime call needing one
    (e.g. a sender thread that only waits for events) has no current context, and the
    driver calls below would fail there."""
    ctx = ctypes.c_void_p()
    if drv.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
        return
    dev = ctypes.c_int()
    rc = drv.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(index))
    if rc == 0:
        rc = drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    if rc == 0:
        rc = drv.cuCtxSetCurrent(ctx)
    if rc != 0:
        raise InvalidArgument("no CUDA context for device %d on this thread (driver error %d)" % (index, rc))


def cuda_ipc_ref(t: Any, name: str, instead: str) -> Tuple[bytes, int]:
    """(cudaIpcMemHandle_t bytes, byte offset of t's first element in that allocation) of a
    torch CUDA tensor, for the daemon to open by CUDA IPC. `instead` ends the error for a
    tensor that has no such handle.

    The handle comes from the driver (the allocation holding t, and t's offset in it), not
    from torch's own CUDA IPC sharing: torch keeps a block it shared alive until a torch
    consumer releases it, which the daemon never does, so every block shared that way would
    stay allocated in this process for good. The caller keeps t alive while the daemon may
    read it (the daemon keeps its mapping; what it reads after t is freed is not t)."""
    import torch
    drv = _driver()
    with torch.cuda.device(t.device):
        torch.cuda.current_stream(t.device)
        _bind_primary_context(drv, t.device.index or 0)
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        rc = drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(t.data_ptr()))
        if rc != 0:
            raise InvalidArgument("%s: the CUDA driver finds no allocation at its address (error %d); %s"
                                  % (name, rc, instead))
        handle = ctypes.create_string_buffer(64)
        rc = drv.cuIpcGetMemHandle(handle, base.value)
        if rc != 0:
            raise InvalidArgument("%s has no CUDA IPC handle (cuIpcGetMemHandle error %d: memory of an expandable "
                                  "segment, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or of a virtual memory "
                                  "mapping has none); %s" % (name, rc, instead))
    return handle.raw, t.data_ptr() - base.value


SELECT_PURPOSES = {"synchronous": _abi.KVSHADE_SELECT_SYNCHRONOUS, "speculative": _abi.KVSHADE_SELECT_SPECULATIVE,
                   "correction": _abi.KVSHADE_SELECT_CORRECTION}


def _purpose_code(purpose):
    if purpose not in SELECT_PURPOSES:
        raise InvalidArgument("purpose must be one of %s, got %r" % (sorted(SELECT_PURPOSES), purpose))
    return SELECT_PURPOSES[purpose]


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def _copy_f32(ptr, count, shape):
    if count == 0:
        return np.zeros(shape, dtype=np.float32)
    return np.ctypeslib.as_array(ptr, shape=(count,)).copy().reshape(shape)


# Rows as the server sent them: KVSHADE_DTYPE_* -> (name, numpy dtype of the elements; bf16
# as its raw 16 bits).
_ROW_DTYPES = {1: ("bf16", np.uint16), 2: ("fp16", np.float16), 3: ("float32", np.float32)}


def _copy_rows(ptr, code, count, shape):
    """A copy of `count` elements of dtype code `code` at address ptr (a c_void_p) as an
    array of `shape`, and the dtype's name."""
    name, np_t = _ROW_DTYPES.get(code, _ROW_DTYPES[3])
    if count == 0 or not ptr.value:
        return np.zeros(shape, dtype=np_t), name
    buf = (ctypes.c_char * (count * np.dtype(np_t).itemsize)).from_address(ptr.value)
    return np.frombuffer(buf, dtype=np_t, count=count).copy().reshape(shape), name


def _check_rows(rows):
    if rows not in ("float32", "wire"):
        raise InvalidArgument('rows must be "float32" or "wire", got %r' % (rows,))


def rows_to_torch(rows: np.ndarray, rows_dtype: str) -> Any:
    """A torch tensor of rows that a call with rows="wire" returned (SlotDelta.keys/values,
    StaticSet.k/v/tail_k/tail_v, with their rows_dtype): bf16 bits become torch.bfloat16
    without a conversion; fp16 and float32 keep their dtype."""
    import torch
    if rows_dtype == "bf16":
        return torch.from_numpy(np.ascontiguousarray(rows).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(rows)


@dataclass
class ModelSpec:
    """The attention geometry of the model (kvshade.v1.ModelSpec)."""
    model_id: str
    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rotary_dim: int = 0
    rope_scaling: str = "none"
    rope_pairing: str = "half"
    rope_factor: float = 0.0
    rope_low_freq_factor: float = 0.0
    rope_high_freq_factor: float = 0.0
    rope_original_max_position: int = 0
    dtype: str = "bf16"

    def _c(self):
        m = _native.Model()
        _native.lib().kvshade_model_init(ctypes.byref(m))
        m.model_id = _b(self.model_id)
        m.num_layers, m.num_query_heads = self.num_layers, self.num_query_heads
        m.num_kv_heads, m.head_dim = self.num_kv_heads, self.head_dim
        m.rope_theta, m.rotary_dim = self.rope_theta, self.rotary_dim
        m.rope_scaling = SCALINGS[self.rope_scaling]
        m.rope_pairing = PAIRINGS[self.rope_pairing]
        m.rope_factor = self.rope_factor
        m.rope_low_freq_factor = self.rope_low_freq_factor
        m.rope_high_freq_factor = self.rope_high_freq_factor
        m.rope_original_max_position = self.rope_original_max_position
        m.dtype = _dtype_code(self.dtype)
        return m


@dataclass
class Profile:
    """Compression parameters (kvshade.v1.Profile); None = the server's default. 0 is a value
    of its own for outliers, heavy_chunks, min_tokens, mass_min_chunks and the floats other
    than mass_top_p (outliers=0: no outlier chunks); for rank, chunk_size, sparse_budget,
    local_window, kivi_group, rerank_factor and mass_top_p, where 0 is not valid, 0 also
    means the default.

    Selection options (docs/ALGORITHM.md "Selection options"): rerank_factor (two-stage
    selection: stage 1 keeps rerank_factor x k candidates per head, stage 2 re-ranks them;
    1 = one stage), mass_top_p / mass_min_chunks (per head the fewest chunks whose
    estimated attention mass reaches mass_top_p, at least mass_min_chunks, at most
    sparse_budget), recall_sample_rate / recall_floor / recall_action ("report", "widen" or
    "exact"; the recall guard).

    key_signature_bits (shadow only; docs/ALGORITHM.md "Key signatures"): 2, 4 or 8-bit key
    signatures of every chunked token, h * (head_dim*bits/8 + 4) device bytes per token and
    layer, which two-stage selection (rerank_factor > 1) scores instead of reconstructing
    keys; 0 = none, None = the server's default.

    selection_unit (shadow only; docs/ALGORITHM.md "Selection units"): select units of this
    many tokens instead of whole chunks, a divisor of chunk_size below it, with
    rerank_factor > 1; the same token budget (sparse_budget * chunk_size / selection_unit
    units per KV head; mass_min_chunks then counts units). 0 or chunk_size = whole chunks,
    None = the server's default."""
    kind: str = "auto"
    rank: int = 0
    chunk_size: int = 0
    sparse_budget: int = 0
    outliers: Optional[int] = None
    keep_sink: Optional[bool] = None
    local_window: int = 0
    heavy_chunks: Optional[int] = None
    value_codec: str = "default"
    min_tokens: Optional[int] = None
    refactor_threshold: Optional[float] = None
    energy_target: Optional[float] = None
    mini_recent_ratio: Optional[float] = None
    mini_heavy_ratio: Optional[float] = None
    kivi_group: int = 0
    rerank_factor: int = 0
    mass_top_p: float = 0.0
    mass_min_chunks: Optional[int] = None
    recall_sample_rate: Optional[float] = None
    recall_floor: Optional[float] = None
    recall_action: str = "default"
    key_signature_bits: Optional[int] = None
    selection_unit: Optional[int] = None

    def _c(self):
        p = _native.Profile()
        _native.lib().kvshade_profile_init(ctypes.byref(p))
        if self.kind not in PROFILES:
            raise InvalidArgument("profile kind must be one of %s, got %r" % (sorted(PROFILES), self.kind))
        p.kind = PROFILES[self.kind]
        for name in ("rank", "chunk_size", "sparse_budget", "outliers", "local_window", "heavy_chunks",
                     "min_tokens", "refactor_threshold", "energy_target", "mini_recent_ratio",
                     "mini_heavy_ratio", "kivi_group", "rerank_factor", "mass_top_p", "mass_min_chunks",
                     "recall_sample_rate", "recall_floor", "key_signature_bits", "selection_unit"):
            if getattr(self, name) is not None:  # None: the init's "server default"
                setattr(p, name, getattr(self, name))
        p.keep_sink = -1 if self.keep_sink is None else int(bool(self.keep_sink))
        p.value_codec = CODECS[self.value_codec]
        if self.recall_action not in RECALL_ACTIONS:
            raise InvalidArgument("recall_action must be one of %s, got %r"
                                  % (sorted(RECALL_ACTIONS), self.recall_action))
        p.recall_action = RECALL_ACTIONS[self.recall_action]
        return p


@dataclass
class CreatedSession:
    session_id: str
    reused_tokens: int
    tokens_to_ingest: int
    effective_profile: str
    # Where the ingest cuts the new tokens into segments (the requested segment_ends it kept
    # and the automatic one); automatic_segment_end 0 = none (docs/DESIGN.md "Segment ends").
    segment_ends: tuple = ()
    automatic_segment_end: int = 0
    # The daemon device it was placed on ("cpu", "cuda:1"; docs/OPERATIONS.md "Devices").
    device: str = ""
    # A tensor-parallel rank's create (create_session(tensor_parallel=...)): the logical
    # session's id, its ranks, this rank and the ranks joined so far; session_id is this
    # rank's shard. "" and 0 for any other session.
    tp_session_id: str = ""
    tp_ranks: int = 0
    tp_rank: int = 0
    tp_ranks_joined: int = 0


@dataclass
class TensorParallel:
    """A rank of a tensor-parallel session (docs/DESIGN.md "Tensor-parallel sessions"): KV
    heads [kv_head_begin, kv_head_end) of the model's num_kv_heads (rank 0 from head 0, the
    last rank to the end, each rank where the one before it ends) and their GQA groups'
    query heads. session_id: the logical session to join (CreatedSession.tp_session_id of
    the rank that created it); "" creates a new one. query_head_begin/query_head_end: an
    optional check of the rank's query heads (both 0: none)."""
    ranks: int
    rank: int
    kv_head_begin: int
    kv_head_end: int
    session_id: str = ""
    query_head_begin: int = 0
    query_head_end: int = 0

    def _c(self) -> Any:
        t = _native.TensorParallel()
        for name in ("ranks", "rank", "kv_head_begin", "kv_head_end", "query_head_begin", "query_head_end"):
            v = int(getattr(self, name))
            if not 0 <= v < 2 ** 32:
                raise InvalidArgument("TensorParallel.%s must be in [0, 2^32), got %d" % (name, v))
            setattr(t, name, v)
        sid = _b(self.session_id) or b""
        if len(sid) >= _native.ID_CAP:
            raise InvalidArgument("TensorParallel.session_id must be < %d bytes" % _native.ID_CAP)
        t.session_id = sid
        return t


@dataclass
class AttachmentInfo:
    attachment_id: str
    lease_expires_unix_ms: int
    chunk_size: int
    slots_per_head: int
    local_window: int
    writer: bool
    data_plane: bool = False     # the daemon offered a UCX data-plane address
    delivery: str = "inline"     # "inline", "ucx_rma" or "cuda_ipc" (as granted)
    slot_buffer_bytes: int = 0   # bytes each of the K and V slot buffers needs (0 = not given)
    # Tokens (rows) per slot: chunk_size, or the profile's selection_unit (slots_per_head
    # then counts units of that many tokens).
    slot_tokens: int = 0


@dataclass
class StaticSet:
    """One layer's always-attended set: k, v [h, s_max, d] (rows < lengths[h] valid),
    tail_k, tail_v [t, h, d]; float32 (with rows="wire" in the session's dtype as the
    server sent them, rows_dtype: "bf16" as the raw bits in uint16), keys post-RoPE.
    positions [h, s_max] and tail_positions [t]: each row's absolute token position (-1
    past lengths[h], or unknown for a durable session restored from a record written before
    positions were kept)."""
    k: np.ndarray
    v: np.ndarray
    lengths: np.ndarray
    tail_k: np.ndarray
    tail_v: np.ndarray
    positions: Optional[np.ndarray] = None       # [h, s_max] int64
    tail_positions: Optional[np.ndarray] = None  # [t] int64
    rows_dtype: str = "float32"


@dataclass
class SlotDelta:
    """One attachment's slot-table delta for one layer: m misses. When `delivered`, the
    misses' K and V were written into the attachment's registered slot buffers
    (register_slot_buffers) and keys/values are None."""
    attachment_id: str
    head: np.ndarray    # [m] uint32
    slot: np.ndarray    # [m] uint32
    chunk: np.ndarray   # [m] int32
    # [m, C, d] post-RoPE ([m, u, d]: selection units), float32; with rows="wire" in the
    # session's dtype as the server sent them (rows_dtype; "bf16": the raw bits as uint16)
    keys: Optional[np.ndarray]
    values: Optional[np.ndarray]
    hits: int = 0
    selected: int = 0
    delivered: bool = False
    # The recall guard put this layer under a fallback that does not fit the slots: attend
    # it with attend() (the service's attention) instead.
    fallback: bool = False
    tokens: int = 0  # the session's length after the call (one more once a staged token landed)
    # [m] int64: absolute position of the first of each miss's C (u) tokens
    position: Optional[np.ndarray] = None
    rows_dtype: str = "float32"  # the dtype of keys and values: "float32", "bf16" or "fp16"


def _decode_select(lib, r, rows="float32"):
    """The SlotDeltas of a kvshade_select_result handle (copied out; the handle stays owned):
    rows "float32" (widened) or "wire" (as the server sent them)."""
    out = []
    for i in range(lib.kvshade_select_count(r)):
        d = _native.SlotDelta()
        rows_dtype = "float32"
        if rows == "wire":
            code, kp, vp = ctypes.c_int32(), ctypes.c_void_p(), ctypes.c_void_p()
            _check(lib.kvshade_select_delta_rows(r, i, ctypes.byref(d), ctypes.byref(code), ctypes.byref(kp),
                                                 ctypes.byref(vp)))
        else:
            _check(lib.kvshade_select_delta(r, i, ctypes.byref(d)))
        m, C, D = d.m, d.chunk_size, d.head_dim
        u32 = lambda p: np.ctypeslib.as_array(p, shape=(m,)).copy() if m else np.zeros(0, np.uint32)
        chunk = np.ctypeslib.as_array(d.chunk, shape=(m,)).copy() if m else np.zeros(0, np.int32)
        position = np.ctypeslib.as_array(d.position, shape=(m,)).copy() if m else np.zeros(0, np.int64)
        if d.delivered:
            keys = values = None
        elif rows == "wire":
            keys, rows_dtype = _copy_rows(kp, code.value, m * C * D, (m, C, D))
            values, _ = _copy_rows(vp, code.value, m * C * D, (m, C, D))
        else:
            keys, values = _copy_f32(d.keys, m * C * D, (m, C, D)), _copy_f32(d.values, m * C * D, (m, C, D))
        out.append(SlotDelta(d.attachment_id.decode(), u32(d.head), u32(d.slot), chunk, keys, values,
                             d.hits, d.selected, bool(d.delivered), bool(d.fallback), d.tokens, position,
                             rows_dtype))
    return out


class _NativeHandle:
    """Owns one handle of libkvshade (self._h), freed by the C function named `_free`:
    close() is idempotent, and the object is a context manager."""

    _free: str = ""  # the name of the C function that frees the handle
    _h: Any = None

    def close(self) -> None:
        if self._h:
            getattr(_native.lib(), self._free)(self._h)
            self._h = ctypes.c_void_p()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Ingest(_NativeHandle):
    """One Ingest stream (a context manager: leaving it without commit() cancels)."""

    def __init__(self, client: "Client", session_id: str, dtype: str) -> None:
        self._client = client
        self._session_id = session_id
        self._dtype = _dtype_code(dtype)
        self._h = ctypes.c_void_p()
        # layer_cuda tensors the daemon may still read, in the order sent, and how many of
        # the layers sent it has finished with (those are no longer held here).
        self._keep: List[Any] = []
        self._released = 0
        _check(_native.lib().kvshade_ingest_begin(client._handle(), _b(session_id), ctypes.byref(self._h)))

    def layer_cuda(self, layer: int, k: Any, v: Any, token_offset: int = 0, last_part: bool = True,
                   ready: Any = None) -> None:
        """Same node, daemon on a GPU backend: one layer (or, with token_offset / last_part as
        for layer(), one part of it) from this process's GPU memory.
        k, v: torch CUDA tensors [n, h, d] bf16, contiguous (pre-RoPE keys). The daemon reads
        them from there (CUDA IPC); nothing is copied to the host here. They are kept alive
        by this stream until it is closed; release_taken lets them go once the daemon has
        read them. Before the daemon is told, the call waits until they hold their data: for
        `ready` (a torch.cuda.Event recorded after they were written, e.g. by the thread that
        computed them), else for the calling thread's current stream to finish."""
        import torch
        for name, t in (("k", k), ("v", v)):
            if not (isinstance(t, torch.Tensor) and t.is_cuda and t.dtype == torch.bfloat16
                    and t.is_contiguous() and t.dim() == 3):
                raise InvalidArgument("%s must be a contiguous CUDA bfloat16 tensor [n, h, d]" % name)
        if k.shape != v.shape:
            raise InvalidArgument("k and v must have the same shape, got %s and %s" % (tuple(k.shape), tuple(v.shape)))
        refs = [cuda_ipc_ref(k, "k", "ingest it from host memory instead"),
                cuda_ipc_ref(v, "v", "ingest it from host memory instead")]
        if ready is not None:
            ready.synchronize()
        else:
            torch.cuda.current_stream(k.device).synchronize()
        n, h, d = k.shape
        _check(_native.lib().kvshade_ingest_layer_part_cuda_ipc(self._h, layer, int(token_offset), int(bool(last_part)),
                                                                n, h, d, refs[0][0], refs[0][1], refs[1][0],
                                                                refs[1][1]))
        self._keep.append((k, v))

    @property
    def held_cuda_bytes(self) -> int:
        """Bytes of layer_cuda tensors this stream still holds (the daemon may still read them)."""
        return sum(2 * k.numel() * k.element_size() for k, _ in self._keep[self._released:])

    def release_taken(self, max_held_bytes: Optional[int] = None, timeout: float = 600.0) -> int:
        """Drops this stream's references to the layer_cuda tensors the daemon has read (each
        layer_cuda call is one part; GetSession's ingest_parts_taken counts the parts the
        daemon has placed, in the order sent; a daemon without that count: its compressed
        layers, one part each), so that their GPU memory can be reused before the commit.
        With max_held_bytes, waits until at most that many bytes (at least the newest part)
        are still held; an ingest that stops making progress for `timeout` seconds, or a
        session that is no longer ingesting, raises. Returns the parts released so far."""
        import time
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while True:
            info = self._client.get_session(self._session_id)
            taken = int(info.get("ingest_parts_taken", 0)) or int(info["layers_ingested"])
            if info["state"] == "ingesting" and taken < self._released:
                # The daemon resets the count when a stream ends without a commit.
                raise FailedPrecondition("the daemon ended the ingest stream of session %s after %d parts "
                                         "(commit() reports why)" % (self._session_id, self._released))
            done = min(taken, len(self._keep))
            if done > self._released:
                for i in range(self._released, done):
                    self._keep[i] = None
                self._released = done
                deadline = time.monotonic() + timeout
            held = len(self._keep) - self._released
            if max_held_bytes is None or held <= 1 or self.held_cuda_bytes <= max_held_bytes:
                return self._released
            if info["state"] != "ingesting":
                raise FailedPrecondition("session %s is %s, not ingesting: the daemon stopped taking its parts "
                                         "(%d of %d sent taken)" % (self._session_id, info["state"], done,
                                                                    len(self._keep)))
            if time.monotonic() > deadline:
                raise DeadlineExceeded("the daemon took no part of session %s for %.0f s (%d of %d sent taken)"
                                  % (self._session_id, timeout, done, len(self._keep)))
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def layer(self, layer: int, k: Any, v: Any, observation_queries: Any = None, token_offset: int = 0,
              last_part: bool = True) -> None:
        """k, v: [n, h, d] pre-RoPE; observation_queries: [w, hq, d] post-RoPE or None (with
        the layer's last part only). By default one whole layer; a layer may also come in parts:
        tokens [token_offset, token_offset + n) of the ingested range (the prompt after the
        reused prefix), last_part=False on every part but the one that completes it. A layer's
        parts come in order; parts of different layers may interleave (a chunked prefill sends
        each chunk's part of every layer in turn). The bytes are copied before this returns."""
        kw, vw = to_wire(k, self._dtype), to_wire(v, self._dtype)
        if kw.ndim != 3 or kw.shape != vw.shape:
            raise InvalidArgument("k and v must both be [n, h, d], got %s and %s" % (kw.shape, vw.shape))
        n, h, d = kw.shape
        obs, w, hq = None, 0, 0
        if observation_queries is not None:
            obs = to_wire(observation_queries, self._dtype)
            if obs.ndim != 3 or obs.shape[2] != d:
                raise InvalidArgument("observation_queries must be [w, hq, %d], got %s" % (d, obs.shape))
            w, hq = obs.shape[0], obs.shape[1]
        _check(_native.lib().kvshade_ingest_layer_part(self._h, layer, int(token_offset), int(bool(last_part)),
                                                       self._dtype, n, h, d, _ptr(kw), _ptr(vw),
                                                       None if obs is None else _ptr(obs), w, hq))

    def commit(self) -> int:
        tokens = ctypes.c_uint64()
        try:
            _check(_native.lib().kvshade_ingest_commit(self._h, ctypes.byref(tokens)))
        finally:
            self.close()
            self._keep = []  # layer_cuda tensors: the daemon has read them (or the stream failed)
            self._released = 0
        return tokens.value

    _free = "kvshade_ingest_free"


class SelectFuture(_NativeHandle):
    """The answer of Client.select_async: result() waits (once) and returns the SlotDeltas."""

    _free = "kvshade_select_future_free"

    def __init__(self, client: "Client", handle: Any, rows: str = "float32") -> None:
        self._client = client  # the client must outlive the call
        self._h = handle
        self._rows = rows
        self._result: Optional[List[SlotDelta]] = None

    def done(self) -> bool:
        if self._result is not None or not self._h:
            return True
        ready = ctypes.c_int32()
        _check(_native.lib().kvshade_select_future_ready(self._h, ctypes.byref(ready)))
        return bool(ready.value)

    def result(self) -> List["SlotDelta"]:
        if self._result is None:
            if not self._h:
                raise InvalidArgument("future is closed")
            lib = _native.lib()
            r = ctypes.c_void_p()
            try:
                _check(lib.kvshade_select_future_wait(self._h, ctypes.byref(r)))
                try:
                    self._result = _decode_select(lib, r, self._rows)
                finally:
                    lib.kvshade_select_free(r)
            finally:
                self.close()
        assert self._result is not None
        return self._result


class AttendFuture(_NativeHandle):
    """The answer of Client.attend_async: result() waits (once) and returns float32 [n, hq, d]."""

    _free = "kvshade_attend_future_free"

    def __init__(self, client: "Client", handle: Any, shape: Tuple[int, ...]) -> None:
        self._client = client
        self._h = handle
        self._shape = shape
        self._result: Optional[np.ndarray] = None

    def done(self) -> bool:
        if self._result is not None or not self._h:
            return True
        ready = ctypes.c_int32()
        _check(_native.lib().kvshade_attend_future_ready(self._h, ctypes.byref(ready)))
        return bool(ready.value)

    def result(self) -> "np.ndarray":
        if self._result is None:
            if not self._h:
                raise InvalidArgument("future is closed")
            out = np.empty(self._shape, dtype=np.float32)
            try:
                _check(_native.lib().kvshade_attend_future_wait(
                    self._h, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))))
                self._result = out
            finally:
                self.close()
        assert self._result is not None
        return self._result


class Client(_NativeHandle):
    """A connection to one kvshade-server (thread-safe; close() or use as a context manager).

    use_ucx=True: the client connects over UCX at its first attach() (or ingest, append) when
    the daemon offers a data plane (transports `ucx_transports`, the UCX_TLS value; None =
    UCX's choice)
    and the data calls (ingest, append, select, attend) go over it; `ucx_ingest_window` ingest
    messages are in flight per stream (0 = 4); `ucx_busy_poll_us`: how long the client's UCX
    thread keeps polling after its last message and spins on a decode reply before sleeping
    (0 = 50 us, < 0 = none; more: lower latency, a busy core). If UCX cannot connect, or the
    connection dies, calls fall back to gRPC inline with a line on stderr; `ucx_fallbacks`
    counts them."""

    def __init__(self, target: str = "127.0.0.1:50551", token: Optional[str] = None, tls: bool = False,
                 ca_file: Optional[str] = None, cert_file: Optional[str] = None, key_file: Optional[str] = None,
                 server_name: Optional[str] = None, timeout: float = 60.0, max_message_bytes: int = 0,
                 use_ucx: bool = False, ucx_transports: Optional[str] = None, ucx_ingest_window: int = 0,
                 ucx_busy_poll_us: int = 0) -> None:
        lib = _native.lib()
        o = _native.ClientOptions()
        lib.kvshade_client_options_init(ctypes.byref(o))
        o.target, o.bearer_token, o.tls = _b(target), _b(token), int(bool(tls))
        o.ca_file, o.cert_file, o.key_file = _b(ca_file), _b(cert_file), _b(key_file)
        o.tls_server_name = _b(server_name)
        o.timeout_ms = int(timeout * 1000)
        o.max_message_bytes = max_message_bytes
        o.use_ucx = int(bool(use_ucx))
        o.ucx_transports = _b(ucx_transports)
        o.ucx_ingest_window = ucx_ingest_window  # 0 = the library's default (4)
        o.ucx_busy_poll_us = ucx_busy_poll_us  # 0 = the library's default (50 us), < 0 = none
        self._slot_buffers: Dict[str, Any] = {}  # attachment id -> (k, v): kept alive while registered
        # Objects whose native side calls this client from threads of their own (a
        # LocalDecoder renews its leases through it): close() closes them first.
        self._dependents: "weakref.WeakSet[_NativeHandle]" = weakref.WeakSet()
        self._h = ctypes.c_void_p()
        _check(lib.kvshade_connect(ctypes.byref(o), ctypes.byref(self._h)))
        self.target = target

    def _handle(self):
        if not self._h:
            raise InvalidArgument("client is closed")
        return self._h

    _free = "kvshade_client_free"

    def _depend(self, obj: "_NativeHandle") -> None:
        """obj (a handle that uses this client from a thread of its native side) is closed
        when this client closes, before the client itself."""
        self._dependents.add(obj)

    def close(self) -> None:
        """Closes the connection, and first what was opened over it and still calls it from
        a thread of its own (a LocalDecoder's lease renewals): with the client gone they
        would call a freed client."""
        for obj in list(getattr(self, "_dependents", ())):
            obj.close()
        super().close()

    # --- Health ---
    def wait_ready(self, timeout: float = 10.0) -> None:
        _check(_native.lib().kvshade_wait_ready(self._handle(), int(timeout * 1000)))

    def healthy(self) -> bool:
        """True when the server answers SERVING; False when it is not serving (draining),
        unreachable or does not answer in time."""
        from .errors import Unavailable
        s = ctypes.c_int32()
        try:
            _check(_native.lib().kvshade_health(self._handle(), ctypes.byref(s)))
        except (Unavailable, DeadlineExceeded):
            return False
        return bool(s.value)

    # --- UCX data plane ---
    def _ucx_status(self):
        connected, fallbacks = ctypes.c_int32(), ctypes.c_uint64()
        _check(_native.lib().kvshade_ucx_status(self._handle(), ctypes.byref(connected), ctypes.byref(fallbacks)))
        return bool(connected.value), fallbacks.value

    @property
    def ucx_connected(self) -> bool:
        """True while the decode calls go over the UCX data plane."""
        return self._ucx_status()[0]

    @property
    def ucx_fallbacks(self) -> int:
        """Times a call (or the connection) fell back from UCX to gRPC inline."""
        return self._ucx_status()[1]

    # --- Sessions ---
    @staticmethod
    def _tokens(token_ids):
        a = np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64))
        if a.ndim != 1:
            raise InvalidArgument("token_ids must be 1-D, got shape %s" % (a.shape,))
        if a.size and (a.min() < -2**31 or a.max() >= 2**31):
            raise InvalidArgument("token_ids must fit in int32")
        a = a.astype(np.int32)
        return a, a.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))

    def create_session(self, model: ModelSpec, profile: Profile, token_ids: Any, durable: bool = False,
                       label: str = "", segment_ends: Sequence[int] = (),
                       device: Optional[str] = None,
                       tensor_parallel: Optional[TensorParallel] = None) -> "CreatedSession":
        """segment_ends: token positions where the ingested prompt is cut into separately cached
        segments (e.g. the end of a shared document before the question), so that a later prompt
        sharing only that part reuses it; docs/DESIGN.md "Segment ends" has the rules.
        device: on a daemon with several devices (docs/OPERATIONS.md "Devices"), the one to
        place the session on, the worker's GPU: the daemon's name of it ("cuda:1") or its PCI
        bus id (kvshade.routing.local_gpu_pci_bus_id()); None = the daemon's first device.
        tensor_parallel: create (or join) a tensor-parallel session as one of its ranks
        (docs/DESIGN.md "Tensor-parallel sessions"): `model` is the whole model, the session
        created is the rank's shard (session_id; every per-session call takes it and the
        rank's heads only), tp_session_id the logical session (get_session,
        tensor_parallel_shards, fork_session, close_session)."""
        a, p = self._tokens(token_ids)
        ends = [int(e) for e in segment_ends]
        if any(e < 0 for e in ends):
            raise InvalidArgument("segment_ends must not be negative, got %s" % (ends,))
        ends_c = (ctypes.c_uint64 * max(len(ends), 1))(*ends)
        out = _native.SessionCreated()
        tp = ctypes.byref(tensor_parallel._c()) if tensor_parallel is not None else None
        _check(_native.lib().kvshade_create_session_tp(self._handle(), ctypes.byref(model._c()),
                                                       ctypes.byref(profile._c()), p, a.size, int(durable),
                                                       _b(label), ends_c, len(ends), _b(device), tp,
                                                       ctypes.byref(out)))
        return CreatedSession(out.session_id.decode(), out.reused_tokens, out.tokens_to_ingest,
                              PROFILE_NAMES.get(out.effective_profile, str(out.effective_profile)),
                              tuple(out.segment_ends[:out.n_segment_ends]), out.automatic_segment_end,
                              out.device.decode(), out.tp_session_id.decode(), out.tp_ranks, out.tp_rank,
                              out.tp_ranks_joined)

    def lookup_prefix(self, model: ModelSpec, profile: Profile, token_ids: Any,
                      device: Optional[str] = None) -> Tuple[int, int]:
        """(reusable_tokens, cached_segments) on `device` (as create_session's: prefixes are
        cached per device)."""
        a, p = self._tokens(token_ids)
        r, s = ctypes.c_uint64(), ctypes.c_uint64()
        _check(_native.lib().kvshade_lookup_prefix_on(self._handle(), ctypes.byref(model._c()),
                                                      ctypes.byref(profile._c()), p, a.size, _b(device),
                                                      ctypes.byref(r), ctypes.byref(s)))
        return r.value, s.value

    def fork_session(self, parent_session_id: str, at_token: int) -> Tuple[str, int]:
        """(child session id, shared_tokens). A tensor-parallel logical session forks every
        rank's shard at at_token (each rank must have committed it): the child is a logical
        session (its shards: tensor_parallel_shards)."""
        buf = ctypes.create_string_buffer(_native.ID_CAP)
        shared = ctypes.c_uint64()
        _check(_native.lib().kvshade_fork_session(self._handle(), _b(parent_session_id), at_token, buf,
                                                  ctypes.byref(shared)))
        return buf.value.decode(), shared.value

    def get_session(self, session_id: str) -> Dict[str, Any]:
        i = _native.SessionInfo()
        _check(_native.lib().kvshade_get_session(self._handle(), _b(session_id), ctypes.byref(i)))
        return {"session_id": i.session_id.decode(), "model_id": i.model_id.decode(),
                "state": i.state.decode(), "label": i.label.decode(),
                "profile": PROFILE_NAMES.get(i.profile, str(i.profile)), "durable": bool(i.durable),
                "attachments": i.attachments, "layers_ingested": i.layers_ingested, "tokens": i.tokens,
                "reused_tokens": i.reused_tokens, "gpu_bytes": i.gpu_bytes, "host_bytes": i.host_bytes,
                "damaged": bool(i.damaged), "damage": i.damage.decode(errors="replace"),
                "tokens_lost": i.tokens_lost, "ingest_parts_taken": i.ingest_parts_taken,
                "selection_unit": i.selection_unit, "device": i.device.decode(),
                "tensor_parallel": None if i.tp_ranks == 0 else {
                    "session_id": i.tp_session_id.decode(), "ranks": i.tp_ranks, "rank": i.tp_rank,
                    "kv_head_begin": i.tp_kv_head_begin, "kv_head_end": i.tp_kv_head_end,
                    "num_kv_heads": i.tp_num_kv_heads, "ranks_joined": i.tp_ranks_joined}}

    def tensor_parallel_shards(self, session_id: str) -> List[Dict[str, Any]]:
        """The shards of logical session `session_id` in rank order (docs/DESIGN.md
        "Tensor-parallel sessions"), each a dict: rank, kv_head_begin, kv_head_end,
        session_id (the shard's; "" before the rank joined), device, state ("joining" before
        the rank joined, "missing" when its shard is gone), tokens, reused_tokens.
        InvalidArgument for a session that is no logical session."""
        lib = _native.lib()
        n = ctypes.c_size_t()
        _check(lib.kvshade_get_tensor_parallel_shards(self._handle(), _b(session_id), None, 0, ctypes.byref(n)))
        while True:
            cap = n.value
            arr = (_native.TensorParallelShard * max(cap, 1))()
            _check(lib.kvshade_get_tensor_parallel_shards(self._handle(), _b(session_id), arr, cap,
                                                          ctypes.byref(n)))
            if n.value <= cap:
                break
        return [{"rank": x.rank, "kv_head_begin": x.kv_head_begin, "kv_head_end": x.kv_head_end,
                 "session_id": x.session_id.decode(), "device": x.device.decode(), "state": x.state.decode(),
                 "tokens": x.tokens, "reused_tokens": x.reused_tokens} for x in arr[:n.value]]

    def session_selection(self, session_id: str) -> List[Dict[str, Any]]:
        """The recall guard's figures of a session, per layer with sampled decode steps
        (docs/ALGORITHM.md "Recall guard"), worst mean recall first (ties: worst recent
        recall, then lower layer). Each dict: layer, samples (sampled steps), recall (mean
        recall@k over them), recent_recall (mean over the guard's current window), budget
        (chunks per KV head the guard widened to; 0 = the profile's sparse_budget), fallback
        ("widen" or "exact" once the guard put the layer under a fallback: selects mark its
        deltas `fallback` and it is attended through attend(); else None), actions (times
        the guard acted on the layer). Empty when the guard is off or sampled nothing."""
        lib = _native.lib()
        h = ctypes.c_void_p()
        _check(lib.kvshade_get_session_selection(self._handle(), _b(session_id), ctypes.byref(h)))
        try:
            out = []
            for i in range(lib.kvshade_session_selection_count(h)):
                r = _native.LayerSelection()
                _check(lib.kvshade_session_selection_layer(h, i, ctypes.byref(r)))
                out.append({"layer": r.layer, "samples": r.samples, "recall": r.recall,
                            "recent_recall": r.recent_recall, "budget": r.budget,
                            "fallback": FALLBACK_NAMES.get(r.fallback), "actions": r.actions})
        finally:
            lib.kvshade_session_selection_free(h)
        out.sort(key=lambda x: (x["recall"], x["recent_recall"], x["layer"]))
        return out

    def close_session(self, session_id: str) -> None:
        _check(_native.lib().kvshade_close_session(self._handle(), _b(session_id)))

    # --- Data ---
    def ingest(self, session_id: str, dtype: str = "bf16") -> Ingest:
        """An Ingest stream: .layer(l, k, v[, obs]) for every layer, then .commit()."""
        return Ingest(self, session_id, dtype)

    def append(self, session_id: str, token_ids: Any, k: Any, v: Any, attachment_id: Optional[str] = None,
               dtype: str = "bf16") -> int:
        """k, v: [L, t, h, d] pre-RoPE keys and values of t new tokens for every layer."""
        a, p = self._tokens(token_ids)
        kw, vw = to_wire(k, dtype), to_wire(v, dtype)
        if kw.ndim != 4 or kw.shape != vw.shape or kw.shape[1] != a.size:
            raise InvalidArgument("k and v must be [L, t=%d, h, d], got %s and %s" % (a.size, kw.shape, vw.shape))
        L, t, h, d = kw.shape
        tokens = ctypes.c_uint64()
        _check(_native.lib().kvshade_append(self._handle(), _b(session_id), _b(attachment_id), p, t, L,
                                            _dtype_code(dtype), h, d, _ptr(kw), _ptr(vw), ctypes.byref(tokens)))
        return tokens.value

    # --- Workers ---
    def attach(self, session_id: str, worker_id: str = "", lease_ms: int = 0, writer: bool = False,
               delivery: str = "inline", cuda_ipc: Any = None, device: Optional[str] = None) -> "AttachmentInfo":
        """delivery: "inline" (K/V in each select answer), "ucx_rma" (then register_slot_buffers;
        needs use_ucx) or "cuda_ipc" (cuda_ipc = dict(k_handle=bytes(64), k_offset=0,
        v_handle=bytes(64), v_offset=0, bytes=N): the worker's GPU slot buffers). device: the
        worker's device (as create_session's); a session on another device of the daemon is
        FailedPrecondition. None: not checked."""
        codes = {v: k for k, v in DELIVERIES.items()}
        if delivery not in codes:
            raise InvalidArgument("delivery must be one of %s, got %r" % (sorted(codes), delivery))
        lib = _native.lib()
        o = _native.AttachOptions()
        lib.kvshade_attach_options_init(ctypes.byref(o))
        o.session_id, o.worker_id = _b(session_id), _b(worker_id)
        o.lease_ms, o.writer, o.delivery = lease_ms, int(bool(writer)), codes[delivery]
        o.device = _b(device)
        if cuda_ipc is not None:
            for name in ("k_handle", "v_handle"):
                h = bytes(cuda_ipc[name])
                if len(h) != 64:
                    raise InvalidArgument("cuda_ipc[%r] must be 64 bytes (cudaIpcMemHandle_t), got %d"
                                          % (name, len(h)))
                ctypes.memmove(getattr(o, "cuda_ipc_" + name), h, 64)
            o.cuda_ipc_k_offset = cuda_ipc.get("k_offset", 0)
            o.cuda_ipc_v_offset = cuda_ipc.get("v_offset", 0)
            o.cuda_ipc_bytes = cuda_ipc["bytes"]
        out = _native.Attachment()
        _check(lib.kvshade_attach_ex(self._handle(), ctypes.byref(o), ctypes.byref(out)))
        return AttachmentInfo(out.attachment_id.decode(), out.lease_expires_unix_ms, out.chunk_size,
                              out.slots_per_head, out.local_window, bool(out.writer), bool(out.data_plane),
                              DELIVERIES.get(out.delivery, str(out.delivery)), out.slot_buffer_bytes,
                              out.slot_tokens)

    def register_slot_buffers(self, attachment_id: str, k: Any, v: Any) -> None:
        """Host slot buffers of a "ucx_rma" attachment: k and v, writable C-contiguous arrays
        (numpy, or CPU torch tensors) of the same size >= slot_buffer_bytes, laid out
        [L, h, slots_per_head, C, d] bf16 (e.g. uint16 numpy arrays). Selects over UCX then
        write the misses into them (deltas with delivered=True). Kept referenced here until
        detach()."""
        arrays = []
        for name, x in (("k", k), ("v", v)):
            if type(x).__module__.startswith("torch"):
                if x.device.type != "cpu":
                    raise InvalidArgument("%s must be in host memory for ucx_rma, got device %s" % (name, x.device))
                x = x.numpy()  # shares the tensor's memory
            if not isinstance(x, np.ndarray) or not x.flags.c_contiguous or not x.flags.writeable:
                raise InvalidArgument("%s must be a writable C-contiguous array" % name)
            arrays.append(x)
        if arrays[0].nbytes != arrays[1].nbytes or arrays[0].nbytes == 0:
            raise InvalidArgument("k and v must have the same, non-zero size, got %d and %d bytes"
                                  % (arrays[0].nbytes, arrays[1].nbytes))
        _check(_native.lib().kvshade_register_slot_buffers(self._handle(), _b(attachment_id), _ptr(arrays[0]),
                                                           _ptr(arrays[1]), arrays[0].nbytes))
        self._slot_buffers[attachment_id] = tuple(arrays)

    def detach(self, attachment_id: str) -> None:
        _check(_native.lib().kvshade_detach(self._handle(), _b(attachment_id)))
        self._slot_buffers.pop(attachment_id, None)

    def static_set(self, attachment_id: str, layer: int, rows: str = "float32") -> StaticSet:
        """One layer's static set and exact tail. rows: "float32" (widened) or "wire" (in
        the session's dtype as the server sent them; StaticSet.rows_dtype says which)."""
        _check_rows(rows)
        lib = _native.lib()
        h = ctypes.c_void_p()
        _check(lib.kvshade_get_static_set(self._handle(), _b(attachment_id), layer, ctypes.byref(h)))
        try:
            dims = [ctypes.c_int64() for _ in range(4)]
            lib.kvshade_static_set_shape(h, *(ctypes.byref(x) for x in dims))
            lens = ctypes.POINTER(ctypes.c_uint32)()
            lib.kvshade_static_set_data(h, None, None, ctypes.byref(lens), None, None)
            H, S, D, T = (int(x.value) for x in dims)
            if rows == "wire":
                code = ctypes.c_int32()
                rk, rv, rtk, rtv = (ctypes.c_void_p() for _ in range(4))
                lib.kvshade_static_set_rows(h, ctypes.byref(code), ctypes.byref(rk), ctypes.byref(rv),
                                            ctypes.byref(rtk), ctypes.byref(rtv))
                (sk, name), (sv, _) = (_copy_rows(p, code.value, H * S * D, (H, S, D)) for p in (rk, rv))
                (stk, _), (stv, _) = (_copy_rows(p, code.value, T * H * D, (T, H, D)) for p in (rtk, rtv))
            else:
                fp = ctypes.POINTER(ctypes.c_float)
                k, v, tk, tv = fp(), fp(), fp(), fp()
                lib.kvshade_static_set_data(h, ctypes.byref(k), ctypes.byref(v), None, ctypes.byref(tk),
                                            ctypes.byref(tv))
                sk, sv = _copy_f32(k, H * S * D, (H, S, D)), _copy_f32(v, H * S * D, (H, S, D))
                stk, stv = _copy_f32(tk, T * H * D, (T, H, D)), _copy_f32(tv, T * H * D, (T, H, D))
                name = "float32"
            lengths = (np.ctypeslib.as_array(lens, shape=(H,)).copy() if H else np.zeros(0, np.uint32))
            pos, tpos = ctypes.POINTER(ctypes.c_int64)(), ctypes.POINTER(ctypes.c_int64)()
            lib.kvshade_static_set_positions(h, ctypes.byref(pos), ctypes.byref(tpos))
            i64 = lambda p, shape, n: (np.ctypeslib.as_array(p, shape=(n,)).copy().reshape(shape)  # noqa: E731
                                       if n else np.zeros(shape, np.int64))
            return StaticSet(sk, sv, lengths, stk, stv, i64(pos, (H, S), H * S), i64(tpos, (T,), T), name)
        finally:
            lib.kvshade_static_set_free(h)

    def _queries(self, attachment_ids, q, dtype):
        ids = [_b(i) for i in attachment_ids]
        qw = to_wire(q, dtype)
        if qw.ndim == 2:
            qw = qw[None]
        if qw.ndim != 3 or qw.shape[0] != len(ids):
            raise InvalidArgument("q must be [n=%d, hq, d], got %s" % (len(ids), qw.shape))
        arr = (ctypes.c_char_p * len(ids))(*ids)
        return arr, np.ascontiguousarray(qw)

    def _new_tokens(self, n, d, k_new, v_new, stage_token_ids, dtype, stage_required, hold=False):
        """A kvshade_new_tokens for n queries (None when no tokens are given), and the arrays
        it points into (keep them alive through the call)."""
        if k_new is None and v_new is None:
            if stage_token_ids is not None:
                raise InvalidArgument("stage_token_ids needs k_new and v_new")
            if hold:
                raise InvalidArgument("stage_hold needs k_new, v_new and stage_token_ids")
            return None, ()
        if hold and stage_token_ids is None:
            raise InvalidArgument("stage_hold needs stage_token_ids")
        if k_new is None or v_new is None:
            raise InvalidArgument("k_new and v_new must both be given")
        kw, vw = to_wire(k_new, dtype), to_wire(v_new, dtype)
        if kw.ndim == 2:
            kw, vw = kw[None], vw[None]
        if kw.ndim != 3 or kw.shape != vw.shape or kw.shape[0] != n or kw.shape[2] != d:
            raise InvalidArgument("k_new and v_new must be [n=%d, h, d=%d], got %s and %s" % (n, d, kw.shape, vw.shape))
        if stage_required and stage_token_ids is None:
            raise InvalidArgument("a select carries new tokens only to stage them: give stage_token_ids")
        kw, vw = np.ascontiguousarray(kw), np.ascontiguousarray(vw)
        t = _native.NewTokens(kw.shape[1], _ptr(kw), _ptr(vw), None, 1 if hold else 0)
        keep = [kw, vw]
        if stage_token_ids is not None:
            ids = np.ascontiguousarray(np.asarray(stage_token_ids, dtype=np.int32).reshape(-1))
            if ids.size != n:
                raise InvalidArgument("stage_token_ids must have %d entries, got %d" % (n, ids.size))
            t.stage_token_ids = ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
            keep.append(ids)
        return t, keep

    def select(self, layer: int, attachment_ids: Sequence[str], q: Any, dtype: str = "bf16", k_new: Any = None,
               v_new: Any = None, stage_token_ids: Any = None, purpose: str = "synchronous",
               stage_hold: bool = False, rows: str = "float32") -> List[SlotDelta]:
        """One decode step of one layer for a batch: q [n, hq, d] post-RoPE. With k_new,
        v_new [n, h, d] (pre-RoPE keys) and stage_token_ids [n] (< 0: none for that query)
        the step's new tokens are staged as Attend stages them; each delta's `tokens` is the
        session's length after the call. stage_hold=True keeps each token, once its last
        layer is staged, until commit_staged(). purpose: "synchronous", "speculative" or
        "correction" (counted by the daemon, kvshade_decode_selects_total). rows: the
        deltas' keys and values as "float32" (widened) or "wire" (in the session's dtype as
        the server sent them: SlotDelta.rows_dtype; rows_to_torch makes tensors of them)."""
        _check_rows(rows)
        lib = _native.lib()
        ids, qw = self._queries(attachment_ids, q, dtype)
        nt, _keep = self._new_tokens(len(ids), qw.shape[2], k_new, v_new, stage_token_ids, dtype, True, stage_hold)
        r = ctypes.c_void_p()
        _check(lib.kvshade_select_ex(self._handle(), layer, len(ids), ids, _dtype_code(dtype), qw.shape[1],
                                     qw.shape[2], _ptr(qw), None if nt is None else ctypes.byref(nt),
                                     _purpose_code(purpose), ctypes.byref(r)))
        try:
            return _decode_select(lib, r, rows)
        finally:
            lib.kvshade_select_free(r)

    def select_chunks(self, layer: int, attachment_ids: Sequence[str], chunks: Any,
                      rows: str = "float32") -> List[SlotDelta]:
        """Model-native selection: the chunks to attend, chosen by the caller (a model's own
        indexer), served through the attachments' slot tables like select()'s: chunks
        [n, h, m] (or [h, m] for one attachment) int, -1 = none, m <= slots_per_head. rows
        as select()'s."""
        _check_rows(rows)
        lib = _native.lib()
        ids = [_b(i) for i in attachment_ids]
        cw = np.asarray(chunks)
        if cw.ndim == 2:
            cw = cw[None]
        if cw.ndim != 3 or cw.shape[0] != len(ids):
            raise InvalidArgument("chunks must be [n=%d, h, m], got %s" % (len(ids), cw.shape))
        cw = np.ascontiguousarray(cw, dtype=np.int32)
        arr = (ctypes.c_char_p * len(ids))(*ids)
        r = ctypes.c_void_p()
        _check(lib.kvshade_select_chunks(self._handle(), layer, len(ids), arr, cw.shape[1], cw.shape[2],
                                         cw.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                         ctypes.byref(r)))
        try:
            return _decode_select(lib, r, rows)
        finally:
            lib.kvshade_select_free(r)

    def select_async(self, layer: int, attachment_ids: Sequence[str], q: Any, dtype: str = "bf16",
                     purpose: str = "synchronous", rows: str = "float32") -> SelectFuture:
        """select() without waiting: .result() of the returned future gives the deltas (e.g.
        issue layer l+1 while applying layer l, or the next step's select: purpose
        "speculative"); rows as select()'s."""
        _check_rows(rows)
        ids, qw = self._queries(attachment_ids, q, dtype)
        h = ctypes.c_void_p()
        _check(_native.lib().kvshade_select_async_ex(self._handle(), layer, len(ids), ids, _dtype_code(dtype),
                                                     qw.shape[1], qw.shape[2], _ptr(qw), None,
                                                     _purpose_code(purpose), ctypes.byref(h)))
        return SelectFuture(self, h, rows)

    def attend_async(self, layer: int, attachment_ids: Sequence[str], q: Any, dtype: str = "bf16") -> AttendFuture:
        """attend() without waiting: .result() gives float32 [n, hq, d]."""
        ids, qw = self._queries(attachment_ids, q, dtype)
        h = ctypes.c_void_p()
        _check(_native.lib().kvshade_attend_async(self._handle(), layer, len(ids), ids, _dtype_code(dtype),
                                                  qw.shape[1], qw.shape[2], _ptr(qw), ctypes.byref(h)))
        return AttendFuture(self, h, qw.shape)

    def attend(self, layer: int, attachment_ids: Sequence[str], q: Any, dtype: str = "bf16", k_new: Any = None,
               v_new: Any = None, stage_token_ids: Any = None, with_lse: bool = False, stage_hold: bool = False) -> Any:
        """Attention inside the service: returns float32 [n, hq, d]. k_new, v_new [n, h, d]
        (pre-RoPE keys): the step's new tokens, attended exactly beside each session, and
        staged where stage_token_ids [n] says so (>= 0; stage_hold=True: held for
        commit_staged() once complete). with_lse=True returns (out, lse [n, hq] float32,
        lengths [n]: the sessions' lengths after the call)."""
        ids, qw = self._queries(attachment_ids, q, dtype)
        nt, _keep = self._new_tokens(len(ids), qw.shape[2], k_new, v_new, stage_token_ids, dtype, False, stage_hold)
        n, hq = qw.shape[0], qw.shape[1]
        out = np.empty(qw.shape, dtype=np.float32)
        lse = np.empty((n, hq), dtype=np.float32)
        lengths = np.empty(n, dtype=np.uint64)
        fp = ctypes.POINTER(ctypes.c_float)
        _check(_native.lib().kvshade_attend_ex(self._handle(), layer, n, ids, _dtype_code(dtype), hq, qw.shape[2],
                                               _ptr(qw), None if nt is None else ctypes.byref(nt),
                                               out.ctypes.data_as(fp), lse.ctypes.data_as(fp),
                                               lengths.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64))))
        return (out, lse, lengths) if with_lse else out

    def commit_staged(self, attachment_id: str, stage_token_id: int, discard: bool = False) -> int:
        """Appends the attachment's held staged token (staged with stage_hold=True) to its
        session, or with discard=True drops it; returns the session's length."""
        tokens = ctypes.c_uint64()
        _check(_native.lib().kvshade_commit_staged(self._handle(), _b(attachment_id), int(stage_token_id),
                                                   1 if discard else 0, ctypes.byref(tokens)))
        return tokens.value

    def stats(self) -> Dict[str, Any]:
        """The caller's figures summed over the daemon's devices (kvshade_stats as a dict:
        backend, version, sessions, attachments, segments, device/host bytes used and
        budget, spilled_bytes, prefix lookups and hits, chunks selected and hits); per
        device: device_stats()."""
        s = _native.Stats()
        _check(_native.lib().kvshade_get_stats(self._handle(), ctypes.byref(s)))
        return {name: (getattr(s, name).decode() if name in ("backend", "version") else getattr(s, name))
                for name, _ in _native.Stats._fields_}

    def device_stats(self) -> List[Dict[str, Any]]:
        """The daemon's devices in its order (its backend list; one on a daemon with one
        device; docs/OPERATIONS.md "Devices"), from one Stats call: per device a dict of
        kvshade_device_stats, "device" (the daemon's name for it: "cpu", "cuda:1"),
        "pci_bus_id" (a CUDA device's, "" on a CPU device), the caller's "sessions",
        "attachments", "segments", "device_bytes_used", "host_bytes_used", "spilled_bytes",
        "prefix_lookups", "prefix_hits", "chunks_selected", "chunk_hits" on it, and the
        device's "device_bytes_budget", "device_bytes_held" and "host_bytes_budget" (its
        share of the daemon's). Empty from a daemon too old to report its devices."""
        n = 8
        while True:
            arr = (_native.DeviceStats * n)()
            count = ctypes.c_size_t()
            _check(_native.lib().kvshade_get_device_stats(self._handle(), arr, n, ctypes.byref(count)))
            if count.value <= n:
                break
            n = count.value  # more devices than room: once more with room for all
        text = ("device", "pci_bus_id")
        return [{name: (getattr(d, name).decode() if name in text else getattr(d, name))
                 for name, _ in _native.DeviceStats._fields_} for d in arr[:count.value]]
