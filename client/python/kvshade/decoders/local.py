"""Same-node decode: attention over kvshade sessions in this process, no RPC per step.

    dec = kvshade.decoders.local.LocalDecoder(client, [attachment_id, ...])     # one per sequence
    for layer in range(L):
        out = dec.attend(layer, q, k_new, v_new)   # q [B, hq, d], k_new/v_new [B, h, d]
    dec.advance()                                    # the step's tokens join the local tail

The daemon on this node exports each attachment's session state (factors, landmarks,
static set and exact tail by CUDA IPC or shared host memory; values in shared host memory);
the decoder maps it once and runs selection, reconstruction and attention itself, on the
current torch CUDA stream, with its slot tables on the GPU. Tensors stay where they are:
CUDA tensors for a daemon on the cuda backend, CPU tensors for one on the cpu backend.
q and the new token's key are post-RoPE (what the model computes); the output is fp32
[B, hq, d]. Tokens decoded here stay exact in the decoder until `refresh()` maps a newer
generation (after the runtime appended them to the sessions). The decoder follows
kvshade.decoders.base.Decoder.

Continuous batching: sequences join() and leave() the batch between steps (a decoder may
start empty, LocalDecoder(client, [])); each keeps its own local tail, so sequences of
different lengths decode together and a finished one frees its memory at once.
"""
import ctypes
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

from .. import _native
from ..client import FALLBACK_NAMES, Client, _NativeHandle, _b, _check

if TYPE_CHECKING:
    import numpy as np
    import torch


def _torch():
    import torch
    return torch


def _typed_ptr(t, ctype):
    """A tensor's address (host or device memory) as the typed pointer kvshade.h declares."""
    return ctypes.cast(t.data_ptr(), ctypes.POINTER(ctype))


class PreparedSequence(_NativeHandle):
    """A sequence made ready to join a LocalDecoder (LocalDecoder.prepare); join() takes it.
    close() lets go of one that never joined (its attachment stays)."""

    _free = "kvshade_prepared_sequence_free"

    def __init__(self, client: Client, attachment_id: str, handle: ctypes.c_void_p) -> None:
        self._h = handle
        self.attachment_id = attachment_id
        client._depend(self)  # freed before the client: freeing it calls the daemon

    def _take(self) -> ctypes.c_void_p:
        if not self._h:
            raise ValueError("the prepared sequence %s was joined or closed" % self.attachment_id)
        h, self._h = self._h, ctypes.c_void_p()
        return h


class LocalDecoder(_NativeHandle):
    def __init__(self, client: Client, attachment_ids: Sequence[str], backend: str = "auto",
                 local_capacity: int = 1024, count_hits: bool = False) -> None:
        ids = [_b(a) for a in attachment_ids]
        arr = (ctypes.c_char_p * len(ids))(*ids)
        self._h = ctypes.c_void_p()
        self._client = client  # the decoder renews leases through it: keep it alive
        _check(_native.lib().kvshade_local_decoder_open(client._handle(), len(ids), arr, _b(backend),
                                                        int(local_capacity), 1 if count_hits else 0,
                                                        ctypes.byref(self._h)))
        client._depend(self)  # closed before the client: its lease renewals call the client
        self._backend_arg = backend
        self.attachment_ids: List[str] = list(attachment_ids)
        self._read_info()

    def _read_info(self) -> None:
        b, L, h, hq, d = (ctypes.c_int32() for _ in range(5))
        _check(_native.lib().kvshade_local_decoder_info(self._h, ctypes.byref(b), ctypes.byref(L), ctypes.byref(h),
                                                        ctypes.byref(hq), ctypes.byref(d), None, None, None))
        self.batch, self.layers, self.kv_heads, self.query_heads, self.head_dim = (
            b.value, L.value, h.value, hq.value, d.value)
        backend = self._backend_arg
        name = _native.lib().kvshade_local_decoder_backend(self._h).decode()
        self.backend = name if backend == "auto" else backend
        # Where the tensors of attend() live: the CUDA device the decoder runs on, or the CPU
        # (unknown, None, until the first sequence of an "auto" decoder joins).
        if not name:
            self.device = None
        else:
            self.device = "cpu" if name == "cpu" else ("cuda:%s" % backend.split(":")[1] if ":" in backend else "cuda")

    def join(self, sequence: Union[str, "PreparedSequence"]) -> int:
        """Continuous batching: adds an attachment's session (its id, or what prepare() made
        of it) at the end of the batch between steps and returns its batch index (the batch
        order is the join order). A PreparedSequence is taken whatever happens."""
        index = ctypes.c_int32()
        if isinstance(sequence, PreparedSequence):
            attachment_id, handle = sequence.attachment_id, sequence._take()
            _check(_native.lib().kvshade_local_decoder_join_prepared(self._h, handle, ctypes.byref(index)))
        else:
            attachment_id = sequence
            _check(_native.lib().kvshade_local_decoder_join(self._h, _b(attachment_id), ctypes.byref(index)))
        self.attachment_ids.append(attachment_id)
        self._read_info()
        return index.value

    def prepare(self, attachment_id: str) -> "PreparedSequence":
        """The first part of join(), which may run on another thread while this decoder steps:
        the daemon's calls and the mapping of the session (its memory opened, its slot tables
        allocated), so that join(prepared) between steps only adds it to the batch. Errors as
        join()'s. The prepared sequence holds the session's generation until it joins or is
        closed; not while this process captures a CUDA graph (it allocates device memory)."""
        h = ctypes.c_void_p()
        _check(_native.lib().kvshade_local_decoder_prepare(self._h, _b(attachment_id), ctypes.byref(h)))
        return PreparedSequence(self._client, attachment_id, h)

    def leave(self, sequence: Union[int, str]) -> None:
        """Removes a sequence (batch index or attachment id) between steps: its local tokens
        are dropped (append them to its session first to keep them) and its memory freed; the
        later sequences move down one index."""
        b = self.attachment_ids.index(sequence) if isinstance(sequence, str) else int(sequence)
        if not 0 <= b < len(self.attachment_ids):
            raise IndexError(f"sequence {sequence} is not in the batch of {len(self.attachment_ids)}")
        _check(_native.lib().kvshade_local_decoder_leave(self._h, b))
        del self.attachment_ids[b]
        self._read_info()

    def _check_tensor(self, name, t, shape):
        torch = _torch()
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be bfloat16, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")

    def attend(self, layer: int, q: "torch.Tensor", k_new: Optional["torch.Tensor"] = None,
               v_new: Optional["torch.Tensor"] = None, out: Optional["torch.Tensor"] = None,
               return_lse: bool = False, chunks: Optional["torch.Tensor"] = None
               ) -> Union["torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"]]:
        """q [B, hq, d] bf16; k_new, v_new [B, h, d] bf16 or None; returns out [B, hq, d] fp32,
        and with return_lse=True (out, lse [B, hq] fp32): the log-sum-exp of each query head's
        scaled scores, to merge with attention over tokens the decoder does not hold.
        chunks: model-native selection, an int32 tensor [B, h, m] on q's device (-1 = none,
        m <= the layer's slots per head): the chunks to attend instead of the profile's
        selection (docs/ALGORITHM.md "Selection options"); refused (InvalidArgument) for
        sessions that select units (Profile.selection_unit)."""
        torch = _torch()
        B, hq, h, d = self.batch, self.query_heads, self.kv_heads, self.head_dim
        self._check_tensor("q", q, (B, hq, d))
        if self.backend != "auto" and q.is_cuda != self.backend.startswith("cuda"):
            raise ValueError(f"the decoder runs on {self.backend!r}: tensors must be on "
                             f"{'a CUDA device' if self.backend.startswith('cuda') else 'the CPU'}, got {q.device}")
        if (k_new is None) != (v_new is None):
            raise ValueError("k_new and v_new must both be given or both be None")
        if k_new is not None:
            self._check_tensor("k_new", k_new, (B, h, d))
            self._check_tensor("v_new", v_new, (B, h, d))
        if out is None:
            out = torch.empty((B, hq, d), dtype=torch.float32, device=q.device)
        elif out.dtype != torch.float32 or tuple(out.shape) != (B, hq, d) or not out.is_contiguous() \
                or out.device != q.device:
            raise ValueError(f"out must be a contiguous float32 [{B}, {hq}, {d}] tensor on {q.device}")
        stream = None
        if q.is_cuda:
            stream = ctypes.c_void_p(torch.cuda.current_stream(q.device).cuda_stream)
        lse = torch.empty((B, hq), dtype=torch.float32, device=q.device) if return_lse else None
        if chunks is not None:
            if chunks.dtype != torch.int32 or chunks.dim() != 3 or tuple(chunks.shape[:2]) != (B, h) \
                    or not chunks.is_contiguous() or chunks.device != q.device:
                raise ValueError(f"chunks must be a contiguous int32 [{B}, {h}, m] tensor on {q.device}")
            _check(_native.lib().kvshade_local_decoder_attend_chunks(
                self._h, int(layer), ctypes.c_void_p(q.data_ptr()), _typed_ptr(chunks, ctypes.c_int32),
                int(chunks.shape[2]), None if k_new is None else ctypes.c_void_p(k_new.data_ptr()),
                None if v_new is None else ctypes.c_void_p(v_new.data_ptr()), _typed_ptr(out, ctypes.c_float),
                None if lse is None else _typed_ptr(lse, ctypes.c_float), stream))
            return (out, lse) if return_lse else out
        _check(_native.lib().kvshade_local_decoder_attend_lse(
            self._h, int(layer), ctypes.c_void_p(q.data_ptr()),
            None if k_new is None else ctypes.c_void_p(k_new.data_ptr()),
            None if v_new is None else ctypes.c_void_p(v_new.data_ptr()),
            _typed_ptr(out, ctypes.c_float), None if lse is None else _typed_ptr(lse, ctypes.c_float), stream))
        return (out, lse) if return_lse else out

    def extend(self, sequence: int, k: "torch.Tensor", v: "torch.Tensor") -> None:
        """Between steps, adds n exact tokens at the end of a sequence's local tail: tokens its
        session does not hold (a prompt's last part, e.g. a question after a shared document
        the session covers), which the next steps attend as they attend earlier steps' tokens.
        k, v: bf16 [layers, n, h, d] (post-RoPE keys), contiguous, on the decoder's device;
        copied in the current CUDA stream's order. ResourceExhausted (nothing added) when
        they do not fit in local_capacity."""
        torch = _torch()
        if k.dim() != 4:
            raise ValueError(f"k must be [layers, n, kv_heads, head_dim], got shape {tuple(k.shape)}")
        shape = (self.layers, int(k.shape[1]), self.kv_heads, self.head_dim)
        self._check_tensor("k", k, shape)
        self._check_tensor("v", v, shape)
        if v.device != k.device:
            raise ValueError(f"k and v must be on one device, got {k.device} and {v.device}")
        if self.backend != "auto" and k.is_cuda != self.backend.startswith("cuda"):
            raise ValueError(f"the decoder runs on {self.backend!r}: tensors must be on "
                             f"{'a CUDA device' if self.backend.startswith('cuda') else 'the CPU'}, got {k.device}")
        stream = ctypes.c_void_p(torch.cuda.current_stream(k.device).cuda_stream) if k.is_cuda else None
        _check(_native.lib().kvshade_local_decoder_extend(
            self._h, int(sequence), int(k.shape[1]), ctypes.c_void_p(k.data_ptr()), ctypes.c_void_p(v.data_ptr()),
            stream))

    def advance(self) -> None:
        """Ends a step whose attend() calls gave k_new / v_new: its tokens join the local tail."""
        _check(_native.lib().kvshade_local_decoder_advance(self._h))

    def refresh(self) -> None:
        """Maps the daemon's current generation (after appends); drops the local tokens it covers."""
        _check(_native.lib().kvshade_local_decoder_refresh(self._h))

    def stats(self) -> Dict[str, Any]:
        """selected / hits (chunks, or units with selection units; hits counted with
        count_hits=True), steps (advance() calls)."""
        sel, hits, steps = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        _check(_native.lib().kvshade_local_decoder_info(self._h, None, None, None, None, None, ctypes.byref(sel),
                                                        ctypes.byref(hits), ctypes.byref(steps)))
        return {"selected": sel.value, "hits": hits.value, "steps": steps.value}

    def selected(self, b: int, layer: int) -> "np.ndarray":
        """The chunk ids sequence b's last step of `layer` selected: int32 numpy [h, k]
        (-1 = none), k the layer's slots per head. With selection units (Profile.selection_unit
        = u) they are unit ids (unit j: tokens [(j*u) % C, +u) of chunk (j*u) // C) and k
        counts units."""
        import numpy as np
        k = ctypes.c_int32()
        _check(_native.lib().kvshade_local_decoder_selected(self._h, int(b), int(layer), None, 0, ctypes.byref(k)))
        out = np.empty((self.kv_heads, k.value), dtype=np.int32)
        _check(_native.lib().kvshade_local_decoder_selected(
            self._h, int(b), int(layer), out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), out.size, None))
        return out

    def selection(self, b: Optional[int] = None) -> List[Dict[str, Any]]:
        """This decoder's recall guard (docs/ALGORITHM.md "Recall guard"): per layer it sampled
        or widened, the lowest mean recall first, for sequence b, or for every sequence when
        b is None (each dict then names its batch index, `sequence`). Keys as
        Client.session_selection's."""
        if b is None:
            out = [dict(rec, sequence=i) for i in range(self.batch) for rec in self.selection(i)]
            out.sort(key=lambda x: (x["recall"], x["recent_recall"], x["sequence"], x["layer"]))
            return out
        n = ctypes.c_size_t()
        _check(_native.lib().kvshade_local_decoder_selection(self._h, int(b), None, 0, ctypes.byref(n)))
        arr = (_native.LayerSelection * max(n.value, 1))()
        _check(_native.lib().kvshade_local_decoder_selection(self._h, int(b), arr, n.value, ctypes.byref(n)))
        return [{"layer": x.layer, "samples": x.samples, "recall": x.recall, "recent_recall": x.recent_recall,
                 "budget": x.budget, "fallback": FALLBACK_NAMES.get(x.fallback), "actions": x.actions}
                for x in arr[:n.value]]

    _free = "kvshade_local_decoder_free"
