"""The fp32 reference attention the Python tests compare every decode path against.

    out = kvshade.testing.attention(q, keys, values, masks)                # [..., hq, d] fp32
    out, lse = kvshade.testing.attention(q, keys, values, masks, return_lse=True)

softmax(q K^T / sqrt(d)) V in float32, per KV head over the concatenation of blocks of
keys and values (e.g. static set | slots | exact tail | tokens decoded locally), with
grouped-query attention: query head j attends with KV head j // (hq / h). Nothing is
fused, nothing is approximated: the scores are materialized, masked rows get -inf, and the
softmax and the products run in torch's fp32. kvshade.decoders.remote.RemoteDecoder (fp32 queries,
and every query on the CPU) and kvshade.integrations.torch_hook.KvShadeKVCache attend with it, so what
the tests compare (the daemon's Attend, kvshade.decoders.local.LocalDecoder, the slot paths) is
measured against one definition.

The log-sum-exp of each query head's scaled scores (return_lse=True) is what merges
attention over disjoint sets of tokens: merge_attention(o1, lse1, o2, lse2).
"""
import math
from typing import TYPE_CHECKING, Optional, Sequence, Tuple, Union

if TYPE_CHECKING:
    import torch

# (torch is imported where used: importing kvshade.decoders.remote needs no torch until it decodes.)
Blocks = Union["torch.Tensor", Sequence["torch.Tensor"]]
Masks = Union[None, "torch.Tensor", Sequence[Optional["torch.Tensor"]]]


def _torch():
    import torch
    return torch


def _cat(blocks: Blocks) -> "torch.Tensor":
    torch = _torch()
    if isinstance(blocks, torch.Tensor):
        return blocks.float()
    parts = [b.float() for b in blocks]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


def _mask(masks: Masks, keys: Blocks) -> Optional["torch.Tensor"]:
    """One bool mask [..., h, N] over the concatenated blocks, or None (every row)."""
    torch = _torch()
    if masks is None or isinstance(masks, torch.Tensor):
        return masks
    blocks = [keys] if isinstance(keys, torch.Tensor) else list(keys)
    if len(masks) != len(blocks):
        raise ValueError("masks must have one entry per block (%d), got %d" % (len(blocks), len(masks)))
    if all(m is None for m in masks):
        return None
    parts = [torch.ones(b.shape[:-1], dtype=torch.bool, device=b.device) if m is None else m.to(torch.bool)
             for b, m in zip(blocks, masks)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def attention(q: "torch.Tensor", keys: Blocks, values: Blocks, masks: Masks = None, *,
              return_lse: bool = False) -> Union["torch.Tensor", Tuple["torch.Tensor", "torch.Tensor"]]:
    """Reference attention in fp32.

    q       [..., hq, d] (post-RoPE), any float dtype
    keys    [..., h, n, d] (post-RoPE), or a sequence of blocks [..., h, n_i, d] attended as
            one run of n = sum(n_i) rows (concatenated on the row axis)
    values  the same shapes as keys
    masks   which rows are attended (True) per KV head: None (all of them), one bool
            tensor [..., h, n], or one entry per block (None: all of its rows; a bool
            tensor [..., h, n_i]); broadcast over the query heads of each KV head
    hq must be a multiple of h (grouped-query attention: query head j attends with KV head
    j // (hq // h)). Returns out [..., hq, d] float32 on q's device, and with
    return_lse=True (out, lse [..., hq] float32): the log-sum-exp of each query head's
    scaled scores over its attended rows (-inf where none is; out is NaN there, as a
    softmax over nothing is).
    """
    torch = _torch()
    k, v = _cat(keys), _cat(values)
    mask = _mask(masks, keys)
    qf = q.float()
    *lead, hq, d = qf.shape
    h = k.shape[-3]
    if hq % h:
        raise ValueError("the query heads (%d) must be a multiple of the KV heads (%d)" % (hq, h))
    qg = qf.reshape(*lead, h, hq // h, d)  # a KV head's query heads as its queries
    scores = torch.matmul(qg, k.transpose(-2, -1)) * (1.0 / math.sqrt(d))  # [..., h, g, n]
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(-2), float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v).reshape(*lead, hq, d)
    if not return_lse:
        return out
    return out, torch.logsumexp(scores, dim=-1).reshape(*lead, hq)


def merge_attention(o1: "torch.Tensor", lse1: "torch.Tensor", o2: "torch.Tensor",
                    lse2: "torch.Tensor") -> Tuple["torch.Tensor", "torch.Tensor"]:
    """Attention over the union of two disjoint sets of rows from each set's (out, lse):
    o = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2), lse = log(e^lse1 + e^lse2), in fp32
    (computed relative to the larger lse, so nothing overflows; a set with lse = -inf, no
    rows, adds nothing). o [..., hq, d], lse [..., hq]."""
    torch = _torch()
    lse1, lse2 = lse1.float(), lse2.float()
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2

    def part(w, o):  # w * o, and nothing from a set without rows (its o is NaN)
        w = w.unsqueeze(-1)
        return torch.where(w > 0, w * o.float(), torch.zeros((), dtype=torch.float32, device=o.device))

    return (part(w1, o1) + part(w2, o2)) / total.unsqueeze(-1), m + torch.log(total)
