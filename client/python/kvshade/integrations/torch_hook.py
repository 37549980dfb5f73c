"""A plain-torch attention hook: one sequence's long-context KV cache held by kvshade.

A Llama-style model calls, per layer and decode step, ``cache.attend(layer, q, k, v)`` in
place of "append k, v to my dense cache and attend over it". The hook keeps what the
worker side of ShadowKV keeps (docs/ALGORITHM.md, "Decode"): per layer the static set and exact
tail from GetStaticSet, the slot buffers that SelectAndReconstruct deltas fill in (only
misses move), and the tokens generated since the prompt (exact, local). Attention is
computed here in float32 over static set + slots + tail + local tokens.

Shapes (torch, any device; results on q's device):
  prefill keys/values : per layer [n, h, d], keys pre-RoPE (the service applies RoPE)
  attend q            : [hq, d] post-RoPE query of the newest token
  attend k, v         : [h, d] the newest token's post-RoPE key and its value
  attend result       : [hq, d] float32

Devices: on a daemon with several GPUs (docs/OPERATIONS.md "Devices") the session goes to
the GPU of the prefill's keys (kvshade.routing.session_device: found among the daemon's
devices by PCI bus id; the daemon's first device when it is not one of them, since this
hook's decode is RPC and serves a worker on any node). `device=` overrides it: a str is the
daemon's name of a device or a PCI bus id ("" = its first device), a torch.device or an int
this process's GPU.
"""
from typing import Any, List, Optional

import numpy as np
import torch

from ..client import Client, ModelSpec, Profile, StaticSet
from ..routing import session_device
from ..testing import attention


class StaticSets:
    """Each layer's static set and exact tail (GetStaticSet) for one attachment, fetched on
    first use: a cache whose decode runs elsewhere (a same-node LocalDecoder reads them from
    the daemon's memory) never pays the per-layer calls between the commit and the first
    step (0.1-0.9 s for a 32-layer Llama-3-8B-shaped session on a 2-core VM:
    bench/probes/static_sets.py)."""

    def __init__(self, client: Client, attachment_id: str, num_layers: int) -> None:
        self._client, self._attachment_id = client, attachment_id
        self._sets: List[Optional[StaticSet]] = [None] * num_layers

    def __len__(self) -> int:
        return len(self._sets)

    def __getitem__(self, layer: int) -> StaticSet:
        st = self._sets[layer]
        if st is None:
            st = self._sets[layer] = self._client.static_set(self._attachment_id, layer)
        return st

    def loaded(self) -> int:
        """How many layers have been fetched."""
        return sum(st is not None for st in self._sets)


class KvShadeKVCache:
    def __init__(self, client: Client, model: ModelSpec, profile: Profile, worker_id: str = "torch-hook",
                 device: Any = None) -> None:
        self.client, self.model, self.profile = client, model, profile
        self.worker_id = worker_id
        # The `device` of create_session and attach: the str the daemon is given once known
        # (prefill resolves None / a torch.device from the keys' device).
        self.device = device
        self.session_id: Optional[str] = None
        self.attachment: Any = None  # AttachmentInfo once attached
        self.effective_profile: Optional[str] = None
        self.reused_tokens = 0
        self.hits = 0
        self.selected = 0

    # --- Setup ---
    def prefill(self, token_ids: Any, keys: Any, values: Any, observation_queries: Any = None,
                attach: bool = True) -> Any:
        """Registers the prompt and ingests what no cached prefix covers, then attaches
        (unless attach=False: another decoder attaches to self.session_id)."""
        m = self.model
        if len(keys) != m.num_layers or len(values) != m.num_layers:
            raise ValueError("keys and values need one [n, h, d] tensor per layer (%d)" % m.num_layers)
        if not isinstance(self.device, str):
            self.device = session_device(self.client, self.device, getattr(keys[0], "device", None), same_node=False)
        created = self.client.create_session(m, self.profile, token_ids, device=self.device)
        self.session_id = created.session_id
        self.effective_profile = created.effective_profile
        self.reused_tokens = r = created.reused_tokens
        if created.tokens_to_ingest > 0:
            with self.client.ingest(self.session_id, m.dtype) as ing:
                for layer in range(m.num_layers):
                    obs = None if observation_queries is None else observation_queries[layer]
                    ing.layer(layer, keys[layer][r:], values[layer][r:], obs)
                ing.commit()
        if attach:
            self.attach(self.session_id)
        return created

    def attach(self, session_id: str, effective_profile: Optional[str] = None, device: Any = None) -> None:
        """Attaches to an existing (e.g. forked) session and loads its static sets. device: the
        worker's device for the daemon's check (a session on another of its devices is
        FailedPrecondition); default the one prefill placed the session on, else unchecked."""
        if device is None and isinstance(self.device, str):
            device = self.device
        self.session_id = session_id
        if effective_profile is not None:
            self.effective_profile = effective_profile
        elif self.effective_profile is None:
            self.effective_profile = self.client.get_session(session_id)["profile"]
        self.attachment = self.client.attach(session_id, self.worker_id, device=device or None)
        self.reload_static()

    def reload_static(self) -> None:
        m, a = self.model, self.attachment
        self._static = StaticSets(self.client, a.attachment_id, m.num_layers)
        # Rows per slot: the chunk size, or the profile's selection unit.
        h, d, C, S = m.num_kv_heads, m.head_dim, a.slot_tokens or a.chunk_size, a.slots_per_head
        self._slot_k = [np.zeros((h, S, C, d), np.float32) for _ in range(m.num_layers)]
        self._slot_v = [np.zeros((h, S, C, d), np.float32) for _ in range(m.num_layers)]
        self._slot_used = [np.zeros((h, S), bool) for _ in range(m.num_layers)]
        self._local_k: List[List[torch.Tensor]] = [[] for _ in range(m.num_layers)]
        self._local_v: List[List[torch.Tensor]] = [[] for _ in range(m.num_layers)]

    def close(self, close_session: bool = False) -> None:
        if self.attachment is not None:
            self.client.detach(self.attachment.attachment_id)
            self.attachment = None
        if close_session and self.session_id is not None:
            self.client.close_session(self.session_id)

    # --- Decode ---
    def _apply(self, layer, delta):
        if len(delta.head) == 0:
            return
        hs, ss = delta.head.astype(np.int64), delta.slot.astype(np.int64)
        self._slot_k[layer][hs, ss] = delta.keys
        self._slot_v[layer][hs, ss] = delta.values
        self._slot_used[layer][hs, ss] = True

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m = self.model
        h, d = m.num_kv_heads, m.head_dim
        g = m.num_query_heads // h
        dev = q.device
        self._local_k[layer].append(k.detach().float().cpu().reshape(h, d))
        self._local_v[layer].append(v.detach().float().cpu().reshape(h, d))
        if self.effective_profile == "shadow":
            (delta,) = self.client.select(layer, [self.attachment.attachment_id], q.detach().float().cpu()[None],
                                          dtype=m.dtype)
            self.hits += delta.hits
            self.selected += delta.selected
            self._apply(layer, delta)
        # Per KV head: static set (its valid rows) | the slots holding a chunk | exact tail |
        # local tokens, attended by the head's g query heads (kvshade.testing.attention).
        st = self._static[layer]
        S, C = self.attachment.slots_per_head, self.attachment.slot_tokens or self.attachment.chunk_size
        lk = torch.stack(self._local_k[layer]).transpose(0, 1)  # [h, t_local, d]
        lv = torch.stack(self._local_v[layer]).transpose(0, 1)
        n_static = st.k.shape[1] if len(st.lengths) else 0
        static_k = torch.from_numpy(st.k) if n_static else torch.zeros(h, 0, d)
        static_v = torch.from_numpy(st.v) if n_static else torch.zeros(h, 0, d)
        static_mask = (torch.arange(n_static)[None, :] < torch.from_numpy(st.lengths.astype(np.int64))[:, None]
                       if n_static else None)
        used = torch.from_numpy(self._slot_used[layer]).repeat_interleave(C, dim=1)  # [h, S*C]
        keys = [static_k, torch.from_numpy(self._slot_k[layer]).reshape(h, S * C, d),
                torch.from_numpy(st.tail_k).transpose(0, 1), lk]
        values = [static_v, torch.from_numpy(self._slot_v[layer]).reshape(h, S * C, d),
                  torch.from_numpy(st.tail_v).transpose(0, 1), lv]
        out = attention(q.detach().float().cpu().reshape(h * g, d), keys, values,
                        [static_mask, used, None, None])
        assert isinstance(out, torch.Tensor)  # without with_lse
        return out.to(dev)
