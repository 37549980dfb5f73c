"""Decode attention for a worker that reaches kvshade through its data path: a worker on
another node, or one that cannot map the daemon's memory (kvshade.decoders.local needs both on one
node and the same user).

    dec = kvshade.decoders.remote.RemoteDecoder(client, session_ids, model_spec, device="cuda")
    for layer in range(L):
        out = dec.attend(layer, q, k_new, v_new)   # q [B, hq, d], k_new/v_new [B, h, d]
    dec.close()

The daemon keeps selection and reconstruction (ShadowKV's decode, docs/ALGORITHM.md
"Decode"); this process keeps what a ShadowKV worker keeps, on `device`: per layer the
static set and exact tail (loaded once), the slot buffers the select deltas fill, and the
tokens decoded here (exact). Per layer and step there is one batched select for the whole
batch (over the UCX data plane when the client uses it), and only the misses move, by the
attachments' delivery:
  "cuda_ipc"  the daemon writes them straight into this process's GPU slot buffers (a
              daemon on this node's GPUs, a worker that cannot map the daemon's memory);
  "ucx_rma"   into registered host buffers (UCX RMA: another node), copied to the device;
  "inline"    in the select reply, copied to the device.
"auto" tries them in that order (cuda_ipc only for a CUDA device, ucx_rma only for a client
with a UCX data plane) and keeps the first the daemon grants. Attention runs over static
set + tail, slots and local tokens: per layer they sit side by side in one device buffer
(static set and tail loaded once, the slots copied in per step, each new token written in
place), so a layer is one fused attention call and a handful of copies. For a bf16 or fp16
query on a CUDA device (a model computing in that precision) that call is torch's
scaled_dot_product_attention on the bf16 rows (fp32 softmax inside, as the model's own
attention; no mask once every slot is filled, so the flash kernels qualify): the result of
kvshade.integrations.torch_hook.KvShadeKVCache.attend to bf16 precision. For an fp32 query, and on the
CPU, it is exact softmax in fp32 over the same rows (kvshade.testing.attention, the
reference the torch hook uses too): that result to float rounding.

speculate=True (FreeKV's speculate-and-correct): layer l of step t attends over the chunks
selected with step t-1's query, whose select was issued right after that step's attention
of layer l and ran while the model computed the other layers. Correction is per KV head: a
KV head whose query drifted (cosine to the previous query below `correct_below` for any of
its query heads) is re-selected synchronously with the current query, in one select per
layer for the sequences that have such a head; the other heads of that select carry the
query their slots were selected with, so they select the same chunks again (hits, nothing
delivered) and keep attending over them. stats() counts the speculated and corrected
sequence-layers and KV heads and the time spent waiting for speculative selects.

A layer the daemon's recall guard put under a fallback (docs/ALGORITHM.md "Recall guard":
a budget widened beyond the slots; the select's delta says `fallback`) is attended through
the daemon's Attend for the sessions concerned, which applies the widened budget over the
session's tokens, merged by log-sum-exp with attention over the tokens decoded here (which
the daemon does not hold); the session's layer is selected no more (the guard keeps its
fallback for the session's life). The other layers and sessions keep the slot path.
stats() counts those sequence-layers (`fallbacks`); selection() gives the guard's figures.

Continuous batching: sequences join() and leave() the batch between steps (a decoder may
start empty, RemoteDecoder(client, [], model)); each keeps its own tokens decoded here, so
sequences of different lengths decode together. A sequence keeps one row of the slot
buffers while it stays (the daemon delivers into it); a leave frees the row for the next
join, and a join past the rows held (max_batch, default the first batch) doubles them and
attaches the batch's shadow sessions again (their slots fill again at the next step).

q and the new token's key are post-RoPE (what the model computes); outputs are fp32
[B, hq, d] on `device`. Tokens decoded here are not appended to the sessions. The decoder
follows kvshade.decoders.base.Decoder.
"""
import contextlib
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Union

import numpy as np

from ..client import Client, ModelSpec, cuda_ipc_ref, rows_to_torch
from ..errors import FailedPrecondition, InvalidArgument
from ..testing import attention, merge_attention

if TYPE_CHECKING:
    import torch


def _torch():
    import torch
    return torch


DELIVERY_ORDER = ("cuda_ipc", "ucx_rma", "inline")


class RemoteDecoder:
    def __init__(self, client: Client, session_ids: Sequence[str], model: ModelSpec, device: Any = None,
                 delivery: str = "auto", worker_id: str = "remote-decoder", local_capacity: int = 256,
                 speculate: bool = False, correct_below: float = 0.9, max_batch: Optional[int] = None) -> None:
        torch = _torch()
        if delivery != "auto" and delivery not in DELIVERY_ORDER:
            raise InvalidArgument("delivery must be 'auto' or one of %s, got %r" % (DELIVERY_ORDER, delivery))
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.client, self.model = client, model
        self.layers, self.kv_heads = L, h = model.num_layers, model.num_kv_heads
        self.query_heads, self.head_dim = model.num_query_heads, model.head_dim
        if self.query_heads % h:
            raise InvalidArgument("num_query_heads (%d) must be a multiple of num_kv_heads (%d)" % (self.query_heads, h))
        self.worker_id = worker_id
        self._delivery_arg = delivery
        # Per sequence (batch index b): its session, attachment, profile and slot-buffer row.
        self.batch = 0
        self.session_ids: List[str] = []
        self.attachments: List[Any] = []
        self.profiles: List[str] = []
        self._rows: List[int] = []
        self._sel_index: List[int] = []
        self.hits = self.selected = 0
        # Speculate-and-correct: layer l of step t attends over the chunks selected with
        # step t-1's query (its select ran while the model computed other layers); a KV
        # head whose query drifted (cosine to it below correct_below for any of its query
        # heads) is re-selected synchronously with the current query.
        self.speculate, self.correct_below = bool(speculate), float(correct_below)
        self.speculated = self.corrections = 0
        self.corrected_heads = self.speculated_heads = 0
        self.exposed_wait_s = 0.0
        self.steps = 0      # advance() calls
        self.fallbacks = 0  # sequence-layers attended through the daemon's Attend
        # [layer, b]: the recall guard put the layer of session b under a fallback.
        self._fallback = np.zeros((L, 0), dtype=bool)
        self._pending: List[Any] = [None] * L  # (future, query it was issued with, batch indices)
        # Slot buffers [rows, L, h, S, U, d]: one row per sequence, kept while it stays (a
        # daemon delivering by cuda_ipc or ucx_rma writes into its row); rows of sequences
        # that left are reused by later joins. U = slot_tokens: tokens per slot, the chunk
        # size C, or the profile's selection unit (S then counts units).
        self.delivery, self.chunk_size, self.slots_per_head = "none", 0, 0
        self.slot_tokens = 0
        self._slot_k = self._slot_v = self._host_k = self._host_v = None
        self._slot_used = None  # [L, B, h, S] bool
        self._free_rows: List[int] = []
        self._rows_hint = max(int(max_batch or 0), len(session_ids), 1)
        self._slots_read = None  # CUDA event: this layer's slot buffers were copied out
        # Working buffers per layer (_rebuild): [B, h, N, d] bf16 rows static set + tail |
        # slots | local tokens, and the mask [B, h, 1, N].
        self._local_capacity = max(1, int(local_capacity))
        self._work_k: List[Any] = [None] * L
        self._work_v: List[Any] = [None] * L
        self._work_mask: List[Any] = [None] * L
        self._slot_off = [0] * L            # first slot row (= the widest static set + tail)
        self._sc = 0                        # slot rows per head (S * U once slots exist)
        self._nb: List[List[int]] = [[] for _ in range(L)]      # per sequence: its base rows
        self._local_n = [0] * L             # local rows written (the same row for every sequence)
        self._start: List[List[int]] = [[] for _ in range(L)]   # per sequence: its first local row
        self._base_full = [True] * L
        self._local_full = [True] * L
        self._unmasked = [False] * L
        self._slot_dirty = [True] * L
        self._sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
        try:
            self._add(list(session_ids))
        except BaseException:
            self.close()
            raise

    # --- Membership ---
    def join(self, session_id: str) -> int:
        """Continuous batching: adds a session at the end of the batch between steps and
        returns its batch index. It decodes from its own length (its local tokens start
        empty); the others keep theirs. Sessions of the exact or mini profile join as in the
        constructor; a shadow session must have the decoder's slot geometry. Growing past
        the slot rows held (max_batch, or the widest batch so far) re-attaches the batch's
        shadow sessions once (their slots fill again at the next step)."""
        self._settle()
        self._add([session_id])
        return self.batch - 1

    def leave(self, sequence: Union[int, str]) -> None:
        """Removes a sequence (batch index or session id) between steps: its attachment ends,
        its tokens decoded here are dropped (append them to its session first to keep them)
        and its rows are freed; the later sequences move down one index."""
        b = self.session_ids.index(sequence) if isinstance(sequence, str) else int(sequence)
        if not 0 <= b < self.batch:
            raise IndexError("sequence %s is not in the batch of %d" % (sequence, self.batch))
        self._settle()
        a = self.attachments[b]
        if self._rows:
            self._free_rows.append(self._rows[b])
            self._free_rows.sort()
        keep = [i for i in range(self.batch) if i != b]
        for name in ("session_ids", "attachments", "profiles"):
            setattr(self, name, [getattr(self, name)[i] for i in keep])
        if self._rows:
            self._rows = [self._rows[i] for i in keep]
        self._fallback = self._fallback[:, keep]
        if self._slot_used is not None:
            self._slot_used = self._slot_used[:, keep]
        self._rebuild(keep, [])
        if a is not None:  # last: a failure leaves the decoder consistent without the sequence
            self.client.detach(a.attachment_id)

    def _settle(self):
        """Between steps, before the batch changes: speculative selects in flight land (their
        misses applied) so that no batch index outlives its meaning."""
        for layer, pending in enumerate(self._pending):
            if pending is not None:
                self._pending[layer] = None
                future, _, prev = pending
                self._apply(layer, prev, future.result())

    def _add(self, sids):
        """Attaches `sids` (at the end of the batch), loads their static sets and tails and
        rebuilds the working buffers."""
        c, B0 = self.client, self.batch
        profiles = [c.get_session(s)["profile"] for s in sids]
        shadow = [i for i, p in enumerate(profiles) if p == "shadow"]
        new_attachments: List[Any] = []
        rows: List[int] = []
        try:
            if shadow and self._slot_k is None:
                self._start_slots(sids[shadow[0]], B0 + len(sids))
            elif self._slot_k is not None:
                self._reserve_rows(len(sids))
            rows = [self._free_rows.pop(0) for _ in sids] if self._slot_k is not None else []
            for i, sid in enumerate(sids):
                a = self._attach_one(sid, profiles[i] == "shadow", rows[i] if rows else None)
                new_attachments.append(a)
        except BaseException:
            for a in new_attachments:
                with contextlib.suppress(Exception):
                    c.detach(a.attachment_id)
            self._free_rows = sorted(set(self._free_rows) | set(rows))  # rows taken for this call
            raise
        fresh = [self._load_base(a) for a in new_attachments]
        self.session_ids += list(sids)
        self.attachments += new_attachments
        self.profiles += profiles
        if self._slot_k is not None:
            self._rows += rows
        L, h, S = self.layers, self.kv_heads, self.slots_per_head
        self._fallback = np.concatenate([self._fallback, np.zeros((L, len(sids)), bool)], axis=1)
        if self._slot_k is not None:
            used = self._slot_used if self._slot_used is not None else np.zeros((L, B0, h, S), bool)
            self._slot_used = np.concatenate([used, np.zeros((L, len(sids), h, S), bool)], axis=1)
        self._rebuild(list(range(B0)), fresh)

    def _start_slots(self, probe_sid, batch):
        """The first shadow session: the slot geometry (from a plain attach of it), slot
        buffers of max(max_batch, batch) rows, and the delivery (for "auto" the first of
        cuda_ipc, ucx_rma, inline the daemon grants)."""
        c = self.client
        probe = c.attach(probe_sid, self.worker_id)
        c.detach(probe.attachment_id)
        self.chunk_size, self.slots_per_head = probe.chunk_size, probe.slots_per_head
        self.slot_tokens = probe.slot_tokens or probe.chunk_size
        if self._delivery_arg == "auto":
            self._order = [x for x in DELIVERY_ORDER
                           if (x != "cuda_ipc" or self.device.type == "cuda") and (x != "ucx_rma" or probe.data_plane)]
        else:
            self._order = [self._delivery_arg]
        self._alloc_slots(max(self._rows_hint, batch))
        self._rows = list(range(self.batch))
        self._free_rows = list(range(self.batch, self._slot_k.shape[0]))

    def _alloc_slots(self, rows):
        torch = _torch()
        L, h, d = self.layers, self.kv_heads, self.head_dim
        shape = (rows, L, h, self.slots_per_head, self.slot_tokens, d)
        self._slot_k = torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
        self._slot_v = torch.zeros_like(self._slot_k)
        self._host_k = self._host_v = None

    def _reserve_rows(self, n):
        """At least n free slot rows: beyond the rows held, new buffers of twice as many rows,
        and the batch's shadow sessions attached again onto them."""
        if len(self._free_rows) >= n:
            return
        old = self._slot_k.shape[0]
        rows = max(2 * old, old + n - len(self._free_rows))
        for b in self._sel_index:
            with contextlib.suppress(Exception):
                self.client.detach(self.attachments[b].attachment_id)
            self.attachments[b] = None
        self._alloc_slots(rows)
        self._free_rows = sorted(set(self._free_rows) | set(range(old, rows)))
        for b in self._sel_index:
            self.attachments[b] = self._attach_one(self.session_ids[b], True, self._rows[b])
        # New attachments start with empty slot tables: every slot fills again.
        self._slot_used[:] = False
        self._slot_dirty = [True] * self.layers

    def _attach_one(self, sid, shadow, row):
        """Attaches one session; a shadow one with slot delivery into slot row `row` (the
        first delivery of the decoder's order the daemon grants, which then stays)."""
        c = self.client
        if not shadow:
            return c.attach(sid, self.worker_id)
        errors = []
        for mode in (self._order if self.delivery == "none" else [self.delivery]):
            try:
                a = self._attach_shadow(sid, row, mode)
            except InvalidArgument:
                raise  # the session, not the delivery
            except Exception as e:  # noqa: BLE001 - "auto": the next delivery; else raised below
                errors.append("%s: %s" % (mode, e))
                continue
            self.delivery = mode
            return a
        raise FailedPrecondition("no slot delivery was granted: " + "; ".join(errors))

    def _attach_shadow(self, sid, row, mode):
        """Attaches one shadow session with slot delivery `mode` into slot row `row`."""
        torch = _torch()
        c = self.client
        nbytes = self._slot_k[0].numel() * 2
        if mode == "ucx_rma" and self._host_k is None:
            # Pinned on a CUDA device: each select's layer is then one asynchronous copy.
            pin = self.device.type == "cuda"
            shape = self._slot_k.shape
            self._host_k = torch.zeros(shape, dtype=torch.bfloat16, pin_memory=pin)
            self._host_v = torch.zeros(shape, dtype=torch.bfloat16, pin_memory=pin)
            if not pin:  # the CPU: attention reads the buffers the daemon writes
                self._slot_k, self._slot_v = self._host_k, self._host_v
        if mode == "cuda_ipc":
            instead = "use delivery 'ucx_rma' or 'inline'"
            kh, ko = cuda_ipc_ref(self._slot_k[row], "the slot buffer", instead)
            vh, vo = cuda_ipc_ref(self._slot_v[row], "the slot buffer", instead)
            # The daemon writes into these buffers from its own stream: they must hold
            # their zeros before it does.
            torch.cuda.current_stream(self.device).synchronize()
            a = c.attach(sid, self.worker_id, delivery="cuda_ipc",
                         cuda_ipc=dict(k_handle=kh, k_offset=ko, v_handle=vh, v_offset=vo, bytes=nbytes))
        else:
            a = c.attach(sid, self.worker_id, delivery=mode)
        try:
            geometry = (a.chunk_size, a.slots_per_head, a.slot_tokens or a.chunk_size)
            if geometry != (self.chunk_size, self.slots_per_head, self.slot_tokens):
                raise InvalidArgument("session %s has chunk size %d and %d slots per head of %d tokens, the decoder "
                                      "%d and %d of %d: one RemoteDecoder serves sessions of one slot geometry"
                                      % ((sid,) + geometry + (self.chunk_size, self.slots_per_head,
                                                              self.slot_tokens)))
            if a.delivery != mode:
                raise FailedPrecondition("asked for delivery %r, the daemon granted %r" % (mode, a.delivery))
            if a.slot_buffer_bytes > nbytes:
                raise FailedPrecondition("the slot buffers need %d bytes, %d were sized"
                                         % (a.slot_buffer_bytes, nbytes))
            if mode == "ucx_rma":
                as_bytes = lambda t: t[row].view(-1).view(torch.int16).numpy()  # noqa: E731
                c.register_slot_buffers(a.attachment_id, as_bytes(self._host_k), as_bytes(self._host_v))
        except BaseException:
            with contextlib.suppress(Exception):
                c.detach(a.attachment_id)
            raise
        return a

    def _load_base(self, a):
        """Per layer the static set and exact tail of one attachment: (k, v [h, n, d] torch
        bfloat16, mask [h, n] bool) on the host, the rows as the daemon sent them (no fp32
        round trip for a bf16 session)."""
        torch = _torch()
        h, d = self.kv_heads, self.head_dim
        out = []
        for layer in range(self.layers):
            s = self.client.static_set(a.attachment_id, layer, rows="wire")
            m, t = s.k.shape[1], s.tail_k.shape[0]
            k = np.zeros((h, m + t, d), s.k.dtype)
            v = np.zeros((h, m + t, d), s.k.dtype)
            mask = np.zeros((h, m + t), bool)
            if m:
                k[:, :m] = s.k
                v[:, :m] = s.v
                mask[:, :m] = np.arange(m)[None, :] < s.lengths[:, None]
            k[:, m:] = s.tail_k.transpose(1, 0, 2)
            v[:, m:] = s.tail_v.transpose(1, 0, 2)
            mask[:, m:] = True
            out.append((rows_to_torch(k, s.rows_dtype).to(torch.bfloat16),
                        rows_to_torch(v, s.rows_dtype).to(torch.bfloat16), mask))
        return out

    def _rebuild(self, keep, fresh):
        """New working buffers for the batch of the old sequences `keep` (old batch indices,
        in order) followed by the sequences whose bases `fresh` holds (_load_base). Per
        layer: static set + tail padded to the widest, the slot rows, then the local tokens
        aligned at their end (every sequence writes the next token at the same row; a
        sequence's rows before its first token are masked)."""
        torch = _torch()
        h, d, dev = self.kv_heads, self.head_dim, self.device
        B = len(keep) + len(fresh)
        sc = self.slots_per_head * self.slot_tokens if self._slot_k is not None else 0
        for layer in range(self.layers):
            ok, ov, om = self._work_k[layer], self._work_v[layer], self._work_mask[layer]
            old_local = self._slot_off[layer] + self._sc
            n_old = self._local_n[layer]
            nbs = [self._nb[layer][o] for o in keep] + [f[layer][0].shape[1] for f in fresh]
            counts = [n_old - self._start[layer][o] for o in keep] + [0] * len(fresh)
            nb, n = max(nbs, default=0), max(counts, default=0)
            at = nb + sc
            width = at + max(self._local_capacity, n)
            wk = torch.zeros((B, h, width, d), dtype=torch.bfloat16, device=dev)
            wv = torch.zeros_like(wk)
            wm = torch.zeros((B, h, 1, width), dtype=torch.bool, device=dev)
            wm[:, :, 0, at:] = True  # local tokens: as many as have been written
            for j, o in enumerate(keep):
                m, cnt = nbs[j], counts[j]
                wk[j, :, :m] = ok[o, :, :m]
                wv[j, :, :m] = ov[o, :, :m]
                wm[j, :, 0, :m] = om[o, :, 0, :m]
                src = old_local + self._start[layer][o]
                wk[j, :, at + n - cnt:at + n] = ok[o, :, src:src + cnt]
                wv[j, :, at + n - cnt:at + n] = ov[o, :, src:src + cnt]
                wm[j, :, 0, at:at + n - cnt] = False
            for i, f in enumerate(fresh):
                j = len(keep) + i
                k, v, mask = f[layer]
                m = k.shape[1]
                wk[j, :, :m] = k.to(dev)
                wv[j, :, :m] = v.to(dev)
                wm[j, :, 0, :m] = torch.from_numpy(mask).to(dev)
                wm[j, :, 0, at:at + n] = False
            self._work_k[layer], self._work_v[layer], self._work_mask[layer] = wk, wv, wm
            self._nb[layer] = nbs
            self._start[layer] = [n - cnt for cnt in counts]
            self._slot_off[layer] = nb
            self._local_n[layer] = n
            self._base_full[layer] = bool(wm[:, :, 0, :nb].all()) if B else True
            self._local_full[layer] = all(x == 0 for x in self._start[layer])
        self._sc = sc
        self.batch = B
        self._sel_index = [b for b in range(B) if self.profiles[b] == "shadow"]
        self._slot_dirty = [True] * self.layers
        self._unmasked = [False] * self.layers
        if self._rows:
            self._rows_t = torch.tensor(self._rows, dtype=torch.int64, device=dev)
            self._rows_identity = self._rows == list(range(B))

    # --- Decode ---
    def _check(self, name, t, shape):
        torch = _torch()
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or not t.is_floating_point():
            raise InvalidArgument("%s must be a float tensor of shape %s, got %s"
                                  % (name, shape, tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)))
        if t.device != self.device and not (t.device.type == self.device.type == "cuda"
                                            and self.device.index is None):
            raise InvalidArgument("%s must be on %s, got %s" % (name, self.device, t.device))

    def _apply(self, layer, sessions, deltas):
        """Records the misses of one layer's select (of the sessions at batch indices
        `sessions`) in the slot tables and, where the rows did not land in the device
        buffers themselves, copies them there."""
        torch = _torch()
        for b, dl in zip(sessions, deltas):
            if dl.fallback:
                # The recall guard widened the layer beyond the slots, for the session's life:
                # attend() serves it through the daemon's Attend from now on.
                self._fallback[layer, b] = True
            self.hits += dl.hits
            self.selected += dl.selected
            if len(dl.head) == 0:
                continue
            if not self._slot_used[layer, b, dl.head, dl.slot].all():
                self._slot_used[layer, b, dl.head, dl.slot] = True
                self._slot_dirty[layer] = True
            if self.delivery == "cuda_ipc":
                continue  # already in the device buffers
            if self.delivery == "ucx_rma":
                if self._slot_k is not self._host_k:
                    # The daemon put the rows into the pinned host buffers: the layer's
                    # slots go to the device in one copy each (reads of this layer's buffers
                    # are done: the next select comes after the next step's query reached
                    # the host).
                    r = self._rows[b]
                    self._slot_k[r, layer].copy_(self._host_k[r, layer], non_blocking=True)
                    self._slot_v[r, layer].copy_(self._host_v[r, layer], non_blocking=True)
                continue
            dev = self.device
            hs = torch.from_numpy(dl.head.astype(np.int64)).to(dev)
            ss = torch.from_numpy(dl.slot.astype(np.int64)).to(dev)
            kk = rows_to_torch(dl.keys, dl.rows_dtype).to(dev, torch.bfloat16)
            vv = rows_to_torch(dl.values, dl.rows_dtype).to(dev, torch.bfloat16)
            self._slot_k[self._rows[b], layer, hs, ss] = kk
            self._slot_v[self._rows[b], layer, hs, ss] = vv

    def _ids(self, sessions):
        return [self.attachments[b].attachment_id for b in sessions]

    def _selecting(self, layer):
        """Batch indices of the sessions whose `layer` is served through the slots: the shadow
        sessions that the recall guard has not put under a fallback there."""
        return [b for b in self._sel_index if not self._fallback[layer, b]]

    def _select(self, layer, q):
        """This step's selection for `layer`: synchronous, or (speculate) the select issued
        with the previous step's query, corrected synchronously for the KV heads whose query
        drifted from it. Returns (speculate) the batch indices that select and their queries
        on the host, for the next step's select."""
        torch = _torch()
        sel = self._selecting(layer)
        pending = self._pending[layer] if self.speculate else None
        if pending is not None:
            # The sessions the speculative select was sent for; a layer its delta puts under
            # a fallback is attended through Attend, not corrected.
            self._pending[layer] = None
            future, q_prev, prev = pending
            t0 = time.perf_counter()
            deltas = future.result()
            self.exposed_wait_s += time.perf_counter() - t0
            self._apply(layer, prev, deltas)
            keep = [i for i, b in enumerate(prev) if not self._fallback[layer, b]]
            sel = [prev[i] for i in keep]
            if len(keep) < len(prev):
                q_prev = q_prev[keep]
        if not sel:
            return None
        qs = (q[sel] if len(sel) < self.batch else q).detach()
        if not self.speculate:
            self._apply(layer, sel, self.client.select(layer, self._ids(sel), qs.to(torch.bfloat16), rows="wire"))
            return None
        qf = qs.float().cpu()  # [n, hq, d] on the host: the drift test and the next select
        redo = list(sel)
        if pending is not None:
            # Cosine of each query head to the one the slots were selected with; a KV head
            # drifted when any of its query heads did.
            n, hq, d = qf.shape
            h = self.kv_heads
            cos = torch.nn.functional.cosine_similarity(qf, q_prev, dim=-1)  # [n, hq]
            drifted = (cos < self.correct_below).reshape(n, h, hq // h).any(dim=2)  # [n, h]
            rows = [i for i in range(n) if bool(drifted[i].any())]
            redo = [sel[i] for i in rows]
            self.speculated += n - len(rows)
            self.corrections += len(rows)
            self.corrected_heads += int(drifted.sum())
            self.speculated_heads += n * h - int(drifted.sum())
            if rows:
                # Drifted KV heads select with the current query; the others with the query
                # their slots hold the selection of (the same chunks again: all hits).
                keep = drifted[rows].reshape(len(rows), h, 1, 1)
                mixed = torch.where(keep, qf[rows].reshape(len(rows), h, hq // h, d),
                                    q_prev[rows].reshape(len(rows), h, hq // h, d)).reshape(len(rows), hq, d)
                # (float32 on the host, as the speculative select was sent: the kept heads'
                # rows convert to the same bf16 query.)
                self._apply(layer, redo, self.client.select(layer, self._ids(redo), mixed, purpose="correction",
                                                            rows="wire"))
            return sel, qf
        self._apply(layer, redo, self.client.select(layer, self._ids(redo), qs.to(torch.bfloat16), rows="wire"))
        return sel, qf

    def _speculate(self, layer, selected):
        """Issues the select for this step's query (`selected`: the batch indices and their
        queries on the host, from _select), to be waited for at the next step of `layer`: the
        daemon selects and delivers while the model computes other layers."""
        sel, qf = selected
        keep = [i for i, b in enumerate(sel) if not self._fallback[layer, b]]
        if not keep:
            return
        if len(keep) < len(sel):
            sel, qf = [sel[i] for i in keep], qf[keep]
        if self.delivery in ("cuda_ipc", "ucx_rma") and self.device.type == "cuda":
            # The daemon writes the slot buffers (cuda_ipc) or the host buffers the last
            # copy read (ucx_rma) as soon as it has the request: this layer's reads of them
            # (the copy into the working buffer, queued before the attention) first.
            self._slots_read.synchronize()
        self._pending[layer] = (self.client.select_async(layer, self._ids(sel), qf, purpose="speculative", rows="wire"),
                                qf, sel)

    def attend(self, layer: int, q: "torch.Tensor", k_new: Optional["torch.Tensor"] = None,
               v_new: Optional["torch.Tensor"] = None) -> "torch.Tensor":
        """q [B, hq, d] post-RoPE; k_new, v_new [B, h, d] (the step's token, post-RoPE key)
        or None. Returns fp32 [B, hq, d] on the decoder's device. The token joins the layer's
        local tokens here (advance() only counts the step)."""
        B, hq, h, d, L = self.batch, self.query_heads, self.kv_heads, self.head_dim, self.layers
        if not 0 <= int(layer) < L:
            raise InvalidArgument("layer must be in [0, %d), got %s" % (L, layer))
        self._check("q", q, (B, hq, d))
        if (k_new is None) != (v_new is None):
            raise InvalidArgument("k_new and v_new must both be given or both be None")
        if k_new is not None:
            self._check("k_new", k_new, (B, h, d))
            self._check("v_new", v_new, (B, h, d))
        selected = self._select(layer, q) if self._sel_index else None
        if k_new is not None:
            self._append_local(layer, k_new, v_new)
        out = self._attention(layer, q)
        if selected is not None:
            self._speculate(layer, selected)
        fallback = [b for b in self._sel_index if self._fallback[layer, b]]
        if fallback:
            self._attend_fallback(layer, q, fallback, out)
        return out

    def _local_at(self, layer):
        """The row of the layer's working buffer where its local tokens start."""
        return self._slot_off[layer] + self._sc

    def _attend_fallback(self, layer, q, sessions, out):
        """Writes into out [B, hq, d] the attention of the sessions at batch indices
        `sessions`, whose `layer` is under the recall guard's fallback: the daemon's Attend
        (static set, tail and the guard's widened selection, with the log-sum-exp of each
        query head's scores) merged with attention over the tokens decoded here."""
        torch = _torch()
        idx = torch.tensor(sessions, dtype=torch.int64, device=self.device)
        qb = q.detach()[idx]
        o, lse, _ = self.client.attend(layer, self._ids(sessions), qb, dtype=self.model.dtype, with_lse=True)
        o = torch.from_numpy(o).to(self.device)
        lse = torch.from_numpy(lse).to(self.device)
        n = self._local_n[layer]
        if n:
            at = self._local_at(layer)
            o_local, lse_local = attention(qb, self._work_k[layer][idx, :, at:at + n],
                                           self._work_v[layer][idx, :, at:at + n],
                                           self._work_mask[layer][idx, :, 0, at:at + n], return_lse=True)
            o, _ = merge_attention(o, lse, o_local, lse_local)
        out[idx] = o
        self.fallbacks += len(sessions)

    def _append_local(self, layer, k_new, v_new):
        """The step's token joins the layer's local tokens (exact, kept here), in place in
        the working buffer (grown by doubling when full)."""
        torch = _torch()
        n = self._local_n[layer]
        wk, wv = self._work_k[layer], self._work_v[layer]
        at = self._local_at(layer) + n
        if at == wk.shape[2]:
            grow = max(n, 1)
            pad = lambda t, fill: torch.cat([t, torch.full(t.shape[:-2] + (grow,) + t.shape[-1:], fill,  # noqa: E731
                                                            dtype=t.dtype, device=t.device)], dim=-2)
            self._work_k[layer] = wk = pad(wk, 0)
            self._work_v[layer] = wv = pad(wv, 0)
            self._work_mask[layer] = torch.cat(
                [self._work_mask[layer], torch.ones(self._work_mask[layer].shape[:-1] + (grow,), dtype=torch.bool,
                                                    device=self.device)], dim=-1)
        wk[:, :, at].copy_(k_new.detach())
        wv[:, :, at].copy_(v_new.detach())
        self._local_n[layer] = n + 1

    def _attention(self, layer, q):
        """Attention of q over the layer's working buffer (static set + tail, slots, local
        tokens): bf16 SDPA for a bf16/fp16 query on a CUDA device, exact fp32 otherwise
        (module docstring)."""
        torch = _torch()
        B, hq, h, d = self.batch, self.query_heads, self.kv_heads, self.head_dim
        wk, wv, wm = self._work_k[layer], self._work_v[layer], self._work_mask[layer]
        off = self._slot_off[layer]
        end = off + self._local_n[layer]
        if self._slot_k is not None:
            S, C = self.slots_per_head, self.slot_tokens  # C: tokens per slot (chunk or unit)
            end += S * C
            if self._slot_dirty[layer]:
                used = torch.from_numpy(self._slot_used[layer]).to(self.device)
                wm[:, :, 0, off:off + S * C] = used.repeat_interleave(C, dim=2)
                self._slot_dirty[layer] = False
                self._unmasked[layer] = (self._base_full[layer] and self._local_full[layer]
                                         and bool(self._slot_used[layer].all()))
            if self._rows_identity:
                sk, sv = self._slot_k[:B, layer], self._slot_v[:B, layer]
            else:  # rows freed by sequences that left are reused: gather the batch's rows
                sk, sv = self._slot_k[self._rows_t, layer], self._slot_v[self._rows_t, layer]
            wk[:, :, off:off + S * C].copy_(sk.reshape(B, h, S * C, d))
            wv[:, :, off:off + S * C].copy_(sv.reshape(B, h, S * C, d))
            if self.device.type == "cuda":
                if self._slots_read is None:
                    self._slots_read = torch.cuda.Event()
                self._slots_read.record()
        mask = wm[..., :end]          # [B, h, 1, N]
        if self._sdpa is not None and self.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16):
            # bf16 rows as stored; a KV head's query heads as its queries.
            qb = q.detach().to(torch.bfloat16).reshape(B, h, hq // h, d)
            plain = self._unmasked[layer] or (self._slot_k is None and self._base_full[layer]
                                              and self._local_full[layer])
            out = self._sdpa(qb, wk[:, :, :end], wv[:, :, :end], attn_mask=None if plain else mask)
            return out.reshape(B, hq, d).float()
        # Exact softmax in fp32 over the same rows: the reference (kvshade.testing).
        return attention(q.detach(), wk[:, :, :end], wv[:, :, :end], mask[:, :, 0])

    def advance(self) -> None:
        """Ends a decode step (kvshade.decoders.base.Decoder): counted in stats()["steps"]; the
        step's tokens already joined the local tokens in attend()."""
        self.steps += 1

    def stats(self) -> Dict[str, Any]:
        """selected / hits: chunks over every select (speculative and corrections included);
        steps: advance() calls; fallbacks: sequence-layers attended through the daemon's
        Attend because the recall guard put the layer under a fallback; with speculate:
        speculated (sequence-layers attended over the previous step's selection alone),
        corrections (sequence-layers with at least one KV head re-selected because its query
        drifted), speculated_heads / corrected_heads (the same per KV head), exposed_wait_s
        (time spent waiting for speculative selects that had not come back)."""
        return {"selected": self.selected, "hits": self.hits, "steps": self.steps, "delivery": self.delivery,
                "fallbacks": self.fallbacks, "speculated": self.speculated, "corrections": self.corrections,
                "speculated_heads": self.speculated_heads, "corrected_heads": self.corrected_heads,
                "exposed_wait_s": self.exposed_wait_s}

    def selection(self) -> List[Dict[str, Any]]:
        """The recall guard's figures of the decoder's sessions (Client.session_selection),
        per session and layer with samples, worst mean recall first; each dict also names
        its session (`session_id`) and batch index (`sequence`)."""
        out = []
        for b, sid in enumerate(self.session_ids):
            for rec in self.client.session_selection(sid):
                rec.update(session_id=sid, sequence=b)
                out.append(rec)
        out.sort(key=lambda x: (x["recall"], x["recent_recall"], x["sequence"], x["layer"]))
        return out

    def close(self) -> None:
        """Waits for selects in flight, then detaches every attachment (idempotent)."""
        for layer, pending in enumerate(getattr(self, "_pending", [])):
            if pending is not None:
                try:
                    pending[0].result()  # its deliveries land before the buffers go
                except Exception:  # noqa: BLE001 - the attachment goes anyway
                    pass
                self._pending[layer] = None
        for b, a in enumerate(getattr(self, "attachments", [])):
            if a is not None:
                try:
                    self.client.detach(a.attachment_id)
                except Exception:  # noqa: BLE001 - best effort: the lease ends it otherwise
                    pass
                self.attachments[b] = None

    def __enter__(self) -> "RemoteDecoder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
