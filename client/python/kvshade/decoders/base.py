"""The decoder protocol: what a model runtime drives, layer by layer, to decode a batch of
sequences over kvshade sessions, whichever way the decoder reaches the daemon.

    def decode_step(dec: kvshade.decoders.base.Decoder, qs, ks, vs):
        outs = [dec.attend(layer, qs[layer], ks[layer], vs[layer]) for layer in range(dec.layers)]
        dec.advance()
        return outs

Implementations:
  kvshade.decoders.local.LocalDecoder    same node: maps the daemon's session state and selects,
                                reconstructs and attends in this process (no RPC per step)
  kvshade.decoders.remote.RemoteDecoder  the data path: one select per layer and step, the misses
                                delivered into its slot buffers, attention here

Both are context managers (close() on exit) and runtime-checkable against Decoder:
isinstance(dec, kvshade.decoders.base.Decoder). Shapes: q [batch, query_heads, head_dim]
post-RoPE; k_new, v_new [batch, kv_heads, head_dim] (the step's token, post-RoPE key) or
None; the output is float32 [batch, query_heads, head_dim] on the decoder's device. Each
layer is attended once per step, then advance() ends the step. What each accepts beyond
that (dtypes, devices, extra arguments) is the implementation's.
"""
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class Decoder(Protocol):
    """A batch decoder over kvshade sessions (module docstring)."""

    batch: int        # sequences decoded together (one session each)
    layers: int
    kv_heads: int
    query_heads: int
    head_dim: int

    def attend(self, layer: int, q: "torch.Tensor", k_new: Optional["torch.Tensor"] = None,
               v_new: Optional["torch.Tensor"] = None) -> "torch.Tensor":
        """Attention of one layer of the step for the whole batch: q [B, hq, d] over each
        session's tokens, the tokens decoded earlier and the step's (k_new, v_new [B, h, d]
        or None); returns float32 [B, hq, d]."""
        ...

    def advance(self) -> None:
        """Ends a step whose attend() calls gave k_new / v_new."""
        ...

    def stats(self) -> Dict[str, Any]:
        """Counters; at least "selected" and "hits" (chunks over every selection) and
        "steps" (advance() calls)."""
        ...

    def selection(self) -> List[Dict[str, Any]]:
        """The recall guard's figures of the decoder's sessions, per layer with samples,
        worst recall first (as kvshade.Client.session_selection gives them)."""
        ...

    def close(self) -> None:
        """Releases what the decoder holds (idempotent)."""
        ...

    def __enter__(self) -> "Decoder":
        ...

    def __exit__(self, *exc: object) -> None:
        ...
