"""Hugging Face transformers adapter: a Llama-style model decodes with kvshade holding its
long-context KV cache.

    import kvshade
    from kvshade.integrations import hf_cache
    hf_cache.enable(model)                  # "kvshade" attention function for this model
    cache = hf_cache.KvShadeCache(client, model, kvshade.Profile("shadow"), prompt_ids=ids)
    out = model.generate(ids[None], past_key_values=cache, max_new_tokens=64, do_sample=False)
    print(cache.hit_ratio)
    cache.close(close_session=True)

Two documented transformers hooks do the work, because `Cache.update` never sees the query
that selection needs:
  * `KvShadeCache`, a `transformers.cache_utils.Cache` of one layer object per model layer.
    Prefill (the one forward with q_len > 1): `update` hands the model its own key/value
    states back, so the prompt's attention is the model's own (exact); it also un-rotates
    the post-RoPE keys with the model's own rotary embedding (the cos/sin of positions
    0..n-1) and streams each layer to the daemon while the model computes the next one
    (CreateSession at the first layer reuses a cached prefix): from the GPU by CUDA IPC on
    the same node (each layer let go of once the daemon has taken it: at most
    ingest_window_bytes held), otherwise copied to pinned host memory on a side stream and sent over
    the client's data plane (UCX or gRPC) by a sender thread. After the last layer the
    commit runs while the model finishes the prompt.
    Decode (q_len == 1): `update` records the new token's post-RoPE key and value and
    returns them; the layer lengths keep `get_seq_length`, positions and mask sizes right.
  * `kvshade_attention`, registered with `AttentionInterface.register("kvshade", ...)`.
    For the decode step of a KvShadeCache it hands q and the recorded k, v to the
    decoder (`kvshade.decoders.local.LocalDecoder` or `kvshade.decoders.remote.RemoteDecoder`: static set +
    selected chunks + exact local tokens) and returns [B, 1, hq, d] as transformers'
    attention functions do. Every other call (the prompt,
    or the model used with another cache) goes to the prefill attention, "sdpa" by default.

Contract and limits:
  * Batch size B >= 1 (each sequence its own kvshade session; prompt_ids [B, n], prompts of
    one length, no padding), one prefill forward and then one token per forward (greedy or
    sampled `generate`). Decode attention runs on the model's device over the state the
    daemon on this node exports (`decode="local"`, one batched call per layer), or over
    slot buffers that one batched select per layer fills through the daemon's data path
    (`decode="rpc"`, another node).
    Sequences of different lengths that join and leave one decode batch: kvshade.integrations.serving
    (BatchCache, Generator), over sessions prefilled here with decode=None; transformers'
    own continuous batching (generate_batch, `transformers serve`): kvshade.integrations.hf_batching,
    over the same two pieces.
    Chunked prefill: with prompt_ids naming the whole prompt, the prompt may come in several
    forwards of consecutive tokens (or KvShadeCache.prefill(model, chunk_tokens)); each
    chunk attends to the earlier ones exactly, whose K/V wait in host memory, and each
    chunk's part of every layer goes to the daemon as it is computed (from the GPU on the
    same node, else from host memory).
    Not supported, refused with an error: padded batches, a second multi-token forward
    after the prompt (a new turn: make a new KvShadeCache over the whole conversation, the
    cached prefix is reused), beam search, assisted/speculative decoding
    (crop), torch.compile, sliding-window layers, attention softcapping.
  * RoPE with half-split pairing ("neox", HF Llama); scaling none, linear, llama3 or yarn
    as kvshade implements them. The ModelSpec is derived from the model config and then
    checked against the model's own rotary embedding (inv_freq, attention scaling, cos/sin):
    any mismatch (another rope_type, yarn with explicit attention_factor/mscale, truncate
    off, ...) is refused with the reason instead of decoding with wrong positions.
  * Precision: kvshade stores K and V in bf16. The adapter rounds every key and value it
    holds (prompt and generated tokens) to bf16 and runs the prompt's attention over those
    same values, so an fp32/fp16 model decodes exactly as with a bf16 KV cache; for a bf16
    model this changes nothing. The wire dtype is always bf16.
  * Tokens generated here stay local to the cache (they are not appended to the session).

Needs transformers with the layered cache API (`cache_utils.Cache` built from layer
objects, `DynamicLayer`) and `AttentionInterface`; checked at import with a clear error.
Target: transformers 5.17 with torch 2.11; written against 4.56+ signatures as well.
"""
import math
import threading
import time
import uuid
from typing import Dict, Optional

import numpy as np
import torch

from ..routing import session_device
from .hf_ingest import _DevicePartSender, _LayerSender
# The model's spec and RoPE checks live in hf_model; these names stay reachable here.
from .hf_model import (HfModelSpec, _text_config, find_rotary_embedding, model_spec_from_config,  # noqa: F401
                       rope_mismatch, rope_table)
from .torch_hook import KvShadeKVCache

try:
    import transformers
    from transformers.cache_utils import Cache, DynamicLayer
except ImportError as e:  # the package works without transformers; this module does not
    raise ImportError("kvshade.integrations.hf_cache needs Hugging Face transformers with the layered cache API "
                      "(transformers.cache_utils.Cache and DynamicLayer, transformers >= 4.56): %s" % e) from e
try:
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError as e:
    raise ImportError("kvshade.integrations.hf_cache needs transformers.AttentionInterface and "
                      "transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS (transformers >= 4.48): %s" % e) from e
if not callable(getattr(AttentionInterface, "register", None)):
    raise ImportError("kvshade.integrations.hf_cache: transformers %s has no AttentionInterface.register"
                      % getattr(transformers, "__version__", "?"))

ATTENTION_NAME = "kvshade"
# transformers' continuous batching runs "paged|<name>" (kvshade.integrations.hf_batching registers it); a
# model switched to it decodes through kvshade under both names.
PAGED_ATTENTION_NAME = "paged|" + ATTENTION_NAME
ATTENTION_NAMES = (ATTENTION_NAME, PAGED_ATTENTION_NAME)
# Where kvshade keeps K and V (service/model.cc converts every wire dtype to bf16).
STORE_DTYPE = torch.bfloat16


# --- The attention function -------------------------------------------------------------------

# The (cache, layer, key tensor, phase) of the latest KvShadeCache.update on this thread:
# transformers calls the attention function right after update, with the key update returned.
_current = threading.local()


def _default_attention():
    return ALL_ATTENTION_FUNCTIONS["sdpa"]


def kvshade_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The "kvshade" attention function. query [b, hq, q, d], key/value [b, h, kv, d] as
    update returned them; returns ([b, q, hq, d], None)."""
    entry = getattr(_current, "entry", None)
    if entry is not None and entry[2] is key:
        _current.entry = None
        cache, layer, _, phase = entry
        if phase == "decode":
            if kwargs.get("softcap") or kwargs.get("sliding_window"):
                raise ValueError("kvshade attention: softcap/sliding_window are not supported (layer %d)" % layer)
            return cache._decode_attention(layer, query, key, value, scaling), None
        fn = cache.prefill_attention
    else:
        fn = _default_attention()
    return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def register():
    """Registers `kvshade_attention` as attention implementation "kvshade" (idempotent), with
    sdpa's mask format (the prompt's attention is sdpa's; a decode step needs no mask)."""
    AttentionInterface.register(ATTENTION_NAME, kvshade_attention)
    register_sdpa_mask(ATTENTION_NAME)


def register_sdpa_mask(name):
    """Gives attention implementation `name` the mask function of "sdpa", where the installed
    transformers has the mask interface (4.53+): sdpa's masks skip the mask altogether when
    it is plain causal or a one-token step."""
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        sdpa = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    except (ImportError, KeyError):  # older transformers: masks are the model's own business
        return
    AttentionMaskInterface.register(name, sdpa)


def model_id_of(model, unnamed):
    """The prefix-cache namespace of `model` when the caller names none: its name
    (name_or_path), else `unnamed`. A model without a name (random weights) needs an id of
    its own: sharing a namespace with other weights would reuse wrong K/V."""
    config = _text_config(model.config)
    return getattr(model, "name_or_path", "") or getattr(config, "_name_or_path", "") or unnamed


def require_attention(model):
    """The model's text config, once its attention implementation is kvshade's ("kvshade",
    or "paged|kvshade" for transformers' continuous batching); else a ValueError that says
    how to switch it."""
    config = _text_config(model.config)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ATTENTION_NAMES:
        raise ValueError("the model's attention implementation is %r, not %r: call kvshade.integrations.hf_cache.enable(model) "
                         "(or load it with attn_implementation=%r)" % (impl, ATTENTION_NAME, ATTENTION_NAME))
    return config


def enable(model):
    """Registers the attention function and switches `model` to it (set_attn_implementation
    where the installed transformers has it). The model still runs normally with any other
    cache: those calls go to sdpa. A model already on "paged|kvshade" (kvshade.integrations.hf_batching)
    stays on it: that function serves these caches as well."""
    register()
    if getattr(_text_config(model.config), "_attn_implementation", None) in ATTENTION_NAMES:
        return model
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(ATTENTION_NAME)
    else:
        model.config._attn_implementation = ATTENTION_NAME
    got = getattr(_text_config(model.config), "_attn_implementation", None)
    if got != ATTENTION_NAME:
        raise ValueError("could not switch %s to attention implementation %r (it is %r); load it with "
                         "attn_implementation=%r" % (type(model).__name__, ATTENTION_NAME, got, ATTENTION_NAME))
    return model


register()


# --- Decode through a same-node decoder ----------------------------------------------------------

def decode_query(query, scaling):
    """[B, hq, 1, d] query of a decode step -> [B, hq, d], with any attention scaling other
    than kvshade's 1/sqrt(d) folded in."""
    q = query[:, :, 0, :]
    d = query.shape[-1]
    if scaling is not None and abs(scaling * math.sqrt(d) - 1.0) > 1e-7:
        q = q * (scaling * math.sqrt(d))
    return q


def attend_local(decoder, layer, q, key, value, last_layer):
    """One layer's decode attention of every sequence through a kvshade.decoders.local.LocalDecoder,
    on the model's device with no host copy: q [B, hq, d], key/value [B, h, 1, d] (the step's
    post-RoPE key and its value) -> [B, hq, d] fp32. The model's last layer ends the step."""
    out = decoder.attend(layer, q.to(STORE_DTYPE).contiguous(), key[:, :, 0, :].to(STORE_DTYPE).contiguous(),
                         value[:, :, 0, :].to(STORE_DTYPE).contiguous())
    if last_layer:
        decoder.advance()
    return out


# --- The cache ------------------------------------------------------------------------------------

def _round_to_store(x):
    """x rounded to what kvshade stores (bf16), in x's dtype."""
    return x if x.dtype == STORE_DTYPE else x.to(STORE_DTYPE).to(x.dtype)


class KvShadeCacheLayer(DynamicLayer):
    """One model layer of a KvShadeCache: no tensors, only the token count (the prompt and
    the tokens decoded since) that positions and masks are computed from."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner, layer_idx):
        super().__init__()
        self._owner = owner
        self.layer_idx = layer_idx
        self.length = 0

    def lazy_initialization(self, key_states, value_states=None):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size = key_states.shape[0]
        # Empty placeholders: the K/V live in kvshade (and in the owner's local tokens).
        self.keys = key_states.new_zeros(key_states.shape[0], key_states.shape[1], 0, key_states.shape[3])
        self.values = self.keys
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        # 4.x passes cache_kwargs (sin, cos, cache_position) positionally; 5.x may pass none.
        cache_kwargs = args[0] if args else kwargs.get("cache_kwargs")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._owner._update(self, key_states, value_states, cache_kwargs)

    def _tokens(self):
        """The tokens positions and masks are computed from."""
        return self.length

    def get_seq_length(self, *args, **kwargs):
        return self._tokens()

    def get_mask_sizes(self, query, *args, **kwargs):
        # 5.x passes the query length, 4.x the cache_position tensor.
        if isinstance(query, torch.Tensor):
            q = int(query) if query.dim() == 0 else int(query.shape[0])
        else:
            q = int(query)
        return self._tokens() + q, 0

    def get_max_length(self, *args, **kwargs):
        return -1

    def get_max_cache_shape(self, *args, **kwargs):
        return -1

    def _refuse(self, what):
        raise NotImplementedError("KvShadeCache does not support %s (kvshade holds one sequence's prompt "
                                  "cache; use a DynamicCache for beam search or assisted decoding)" % what)

    def crop(self, *args, **kwargs):
        self._refuse("crop")

    def reorder_cache(self, *args, **kwargs):
        self._refuse("reorder_cache")

    def reset(self, *args, **kwargs):
        self._refuse("reset (make a new KvShadeCache per sequence)")

    def batch_repeat_interleave(self, repeats):
        if repeats != 1:
            self._refuse("batch_repeat_interleave (beam search / num_return_sequences > 1)")

    def batch_select_indices(self, indices):
        if [int(i) for i in indices] != list(range(len(self._owner.hooks))):
            self._refuse("batch_select_indices (dropping or reordering sequences)")

    def offload(self):
        pass

    def prefetch(self):
        pass


_warmed = set()  # devices whose same-node decode context this process has started (_warm_local_decode)
_warmed_lock = threading.Lock()


def _warm_local_decode(client, device):
    """Starts, on a thread, this process's same-node decode context for `device` (the kernel
    backend a LocalDecoder runs on: its library handles, streams and kernels, made once per
    process and device and kept), so that the first prompt's decoder does not pay for it
    after its prefill. Once per device; a failure here only means the decoder pays later."""
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _warmed_lock:
        if index in _warmed:
            return
        _warmed.add(index)

    def warm():
        try:
            from ..decoders.local import LocalDecoder
            LocalDecoder(client, [], backend="cuda:%d" % index).close()
        except Exception:  # noqa: BLE001 - the first decoder opens it then
            pass

    threading.Thread(target=warm, name="kvshade-warm-decode", daemon=True).start()


_SENT = object()  # KvShadeCache._pre_k: the layer is with the host sender
_TAKEN = object()  # KvShadeCache._pre_k: the daemon took the layer from the GPU (device path)


class KvShadeCache(Cache):
    """A transformers Cache whose long-context K/V live in kvshade (see the module doc).

    client   : kvshade.Client
    model    : the transformers model (Llama-style, RoPE, GQA); `enable(model)` first
    profile  : kvshade.Profile ("exact", "shadow", "auto", ...)
    prompt_ids: the prompt's token ids (the prefix-cache key); or set_prompt() before prefill
    model_id : the ModelSpec id (prefix-cache namespace); default model.name_or_path, or a
               fresh id (no reuse) for a model without one
    prefill_attention: attention function (or registered name) for the prompt; "sdpa"
    ingest   : "device" streams each prompt layer to the daemon from the GPU as the prefill
               computes it (same node, daemon on a GPU backend: CUDA IPC, no host copy
               here); "host" sends each layer over the client's data plane (UCX or gRPC) from a
               thread while the prefill computes the next one (a layer on the GPU is
               first copied to pinned host memory on a copy stream of its own, into
               buffers the process keeps for reuse: at most 4 GiB, see _LayerSender);
               "auto" (default) picks "device" for a model on a GPU when the daemon runs on
               the cuda backend and decode is not "rpc"
    decode   : "local" runs decode attention in this process on the model's device over the
               session state the daemon on this node exports (kvshade.decoders.local.LocalDecoder: no
               RPC per layer); "rpc" selects through the daemon's data path, one batched
               select per layer, and attends on the model's device over the misses it
               delivers (kvshade.decoders.remote.RemoteDecoder: a worker on another node); "auto"
               (default) tries "local" and falls back to "rpc" when the daemon's memory
               cannot be mapped here (another node, another user)
    delivery : how the "rpc" path receives the misses (RemoteDecoder): "cuda_ipc", "ucx_rma",
               "inline" or "auto" (default: the first the daemon grants, in that order)
    speculate: the "rpc" path attends over the chunks selected with the previous step's
               query while this step's select runs, re-selecting a sequence's layer only when
               its query drifted (RemoteDecoder speculate / correct_below); default off
    ingest_window_bytes: on the device path, the most bytes of prompt layers (pre-RoPE keys
               and values of every sequence) kept on the GPU for the daemon to read: each
               layer is let go as soon as the daemon has taken it, and the prefill waits
               when the daemon lags by more (at least one layer is always held). The host
               path bounds its GPU copies to the same default (2 GiB). So a prompt's peak
               GPU memory is the forward's own plus this window, not the prompt's K/V.
    decode   : also None: prefill only; once the prompt is committed nothing is attached and
               no decoder opened (session_ids name the ready sessions, for a decoder
               elsewhere, e.g. kvshade.integrations.serving.BatchCache)
    segment_ends: token positions where the daemon cuts each prompt into separately cached
               segments (Client.create_session), e.g. the end of a shared document before
               the question, so that the next question over it reuses the document
    history_device_bytes: a chunked prefill keeps the earlier chunks' exact K/V (what the
               later chunks attend to) on the GPU up to this many bytes, the rest in pinned host
               memory, brought back one layer ahead of each chunk's attention (default 0: all
               in host memory, so the GPU holds only the layers in flight). On the GPU a small
               chunk after a long history does not wait for the host link (about 128 MiB per
               layer of 32K Llama-3-8B tokens); the bytes count against the worker's GPU.
    device   : where the daemon places the sessions (docs/OPERATIONS.md "Devices"). None
               (default): the model's GPU, found among the daemon's devices by PCI bus id
               (kvshade.routing.session_device), so a daemon serving every GPU of the node
               keeps each worker's sessions, and its same-node decode, on the worker's GPU;
               a daemon with one device (or CPU devices only) is given no device, as before;
               a daemon of several GPUs without the model's is InvalidArgument (unless
               decode="rpc": its first device). A torch.device or int: that GPU of this
               process instead. A str goes to the daemon as is: its name of a device
               ("cuda:1", "cpu:0"), a PCI bus id ("0000:3b:00.0"), or "" for its first device
    """

    def __init__(self, client, model, profile, prompt_ids=None, model_id=None, worker_id="hf-cache",
                 prefill_attention="sdpa", decode="auto", count_hits=False, ingest="auto", delivery="auto",
                 speculate=False, correct_below=0.9, ingest_window_bytes=2 << 30, segment_ends=(), device=None,
                 history_device_bytes=0):
        config = require_attention(model)
        if model_id is None:
            model_id = model_id_of(model, "hf-%s-%s" % (getattr(config, "model_type", "model"), uuid.uuid4().hex[:12]))
        self.rotary = find_rotary_embedding(model)
        self.spec = model_spec_from_config(config, model_id, self.rotary)
        self.prefill_attention = (ALL_ATTENTION_FUNCTIONS[prefill_attention]
                                  if isinstance(prefill_attention, str) else prefill_attention)
        self._hook_args = (client, self.spec, profile, worker_id)
        self.hooks = [KvShadeKVCache(client, self.spec, profile, worker_id=worker_id)]  # one per sequence
        self.created = None      # CreateSessionResponse of sequence 0
        self.created_all = []    # of every sequence
        self._prompt_ids = None if prompt_ids is None else self._ids(prompt_ids)
        self._segment_ends = tuple(int(e) for e in segment_ends)
        self._device = device  # the `device=` given; the daemon's str once resolved (_open_ingest)
        L = self.spec.num_layers
        # Per prompt layer until the commit: the pre-RoPE keys and values [B, n, h, d] bf16 on
        # the GPU (same-node streams read them from there), or _SENT once the host sender has them.
        self._pre_k = [None] * L
        self._v = [None] * L
        self._decoding = False
        self._awaiting = None  # a decode layer whose attention has not come through yet
        if decode not in ("auto", "local", "rpc", None):
            raise ValueError("decode must be 'auto', 'local', 'rpc' or None, got %r" % (decode,))
        if int(ingest_window_bytes) <= 0:
            raise ValueError("ingest_window_bytes must be > 0, got %r" % (ingest_window_bytes,))
        self._ingest_window = int(ingest_window_bytes)
        if int(history_device_bytes) < 0:
            raise ValueError("history_device_bytes must be >= 0, got %r" % (history_device_bytes,))
        self._history_device_budget = int(history_device_bytes)
        self.history_bytes_on_device = 0  # earlier chunks' K/V on the GPU now (within history_device_bytes)
        self._sent_layers = []  # device path: prompt layers in the order sent
        self._part_sender = None  # device path, after the first part: _DevicePartSender
        self._keep_prefix_tokens = 0  # keep_prefix()
        # keep_prefix: per layer, [(k, v)] of [1, h, c, d] bf16 in host memory covering the
        # prompt's first keep_prefix tokens, once the prefill is done (None: nothing kept).
        self.kept_prefix = None
        # Chunked prefill (a prompt in several forwards): per layer, the earlier chunks' exact
        # post-RoPE keys and values ([(k, v)] of [B, h, c, d] bf16: on the GPU while they fit
        # history_device_bytes, else in pinned host memory), for the later chunks' attention;
        # a side stream for their copies; the next layer's K/V already on their way
        # ({layer: (k, v, event)}).
        self._chunked = False
        self._history = None
        self._history_stream = None
        self._prefetched = {}
        self._decode_mode = decode
        if ingest not in ("auto", "device", "host"):
            raise ValueError("ingest must be 'auto', 'device' or 'host', got %r" % (ingest,))
        self._ingest_mode = ingest
        self._streams = None  # same-node ingest streams per sequence (None: host path)
        self._sender = None  # _LayerSender of the host path (None: not started or same node)
        self._pending = None  # the thread finishing a same-node ingest (_ingest)
        self._pending_error = None
        # time.perf_counter() when that thread's commit (and decoder open) ended; None before.
        self.committed_at: Optional[float] = None
        self.ingest_error = None  # why ingest="auto" fell back to the host path
        # Host path: {"copy_s", "send_s", "bytes"}, the sender's seconds copying the prompt's
        # layers off the GPU and sending them, and the bytes sent (None on the device path).
        self.host_ingest_times = None
        # When each part of the end of a prompt's ingest ended (time.perf_counter(); filled by
        # the thread that finishes it): "started" (inside the prompt's last layer), "parts"
        # (the same-node parts handed to the daemon), "committed" (the host path's last
        # layers sent too), "attached", "decoder" (opened).
        self.ready_times: Dict[str, float] = {}
        # Seconds of the chunked prefill's own work on this thread, by phase (a profile of
        # where a chunk's time goes beside the model's): "send" (each part to the daemon: on
        # the same node, queueing it for the sender thread and waiting while the parts queued
        # and held exceed ingest_window_bytes; the prompt's first part is sent on this
        # thread), "history" (the chunk's K/V
        # queued to host memory) and "attend_kv" (the earlier chunks' K/V back, waiting for
        # the copy queued one layer ahead).
        self.chunk_times = {"send": 0.0, "history": 0.0, "attend_kv": 0.0}
        self._count_hits = count_hits
        self._model_params_device = {next(model.parameters()).device}
        self.local = None  # kvshade.decoders.local.LocalDecoder once the prompt is ingested (local mode)
        self.local_error = None  # why "auto" fell back to "rpc"
        self.remote = None  # kvshade.decoders.remote.RemoteDecoder on the "rpc" path
        self._delivery = delivery
        self._speculate = (bool(speculate), float(correct_below))
        super().__init__(layers=[KvShadeCacheLayer(self, i) for i in range(L)])

    # --- Public state ---
    @staticmethod
    def _ids(ids):
        """[n] or [B, n] token ids -> B lists of ints."""
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().numpy()
        a = np.asarray(ids)
        if a.ndim == 1:
            a = a[None]
        if a.ndim != 2:
            raise ValueError("prompt_ids must be [n] or [B, n], got shape %s" % (a.shape,))
        return [[int(t) for t in row] for row in a]

    @property
    def hook(self):
        """The KvShadeKVCache of sequence 0."""
        self.wait_ready()
        return self.hooks[0]

    @property
    def session_ids(self):
        self.wait_ready()
        return [h.session_id for h in self.hooks]

    def set_prompt(self, prompt_ids):
        self.wait_ready()
        if self._decoding or self._chunked or any(x is not None for x in self._pre_k):
            raise ValueError("set_prompt must come before the prefill forward")
        self._prompt_ids = self._ids(prompt_ids)

    @property
    def session_id(self):
        return self.hook.session_id

    @property
    def effective_profile(self):
        return self.hook.effective_profile

    def _decode_count(self, name):
        """A decoder's running count ("hits", "selected"): the local decoder's stats, the
        remote decoder's attribute, 0 before either."""
        self.wait_ready()
        if self.local is not None:
            return self.local.stats()[name]
        return getattr(self.remote, name) if self.remote is not None else 0

    @property
    def hits(self):
        return self._decode_count("hits")

    @property
    def selected(self):
        return self._decode_count("selected")

    @property
    def hit_ratio(self):
        """Selected chunks already in a slot / selected chunks (shadow); None before any, and
        None on the local path unless the cache was made with count_hits=True."""
        if self.local is not None and not self._count_hits:
            return None
        sel = self.selected
        return self.hits / sel if sel else None

    def close(self, close_session=False):
        try:
            self.wait_ready()
        finally:
            self._close(close_session)

    def _close(self, close_session):
        self._drop_history()
        if self._sender is not None or self._streams:
            # A prefill that did not reach its last layer: its sessions were never committed
            # and nobody else knows their ids.
            self._cancel_ingest()
        if self.local is not None:
            self.local.close()
            self.local = None
        if self.remote is not None:
            self.remote.close()
            self.remote = None
        for h in self.hooks:
            h.close(close_session=close_session)

    def _cancel_ingest(self):
        """Stops the senders, closes the ingest streams (nothing committed) and the sessions
        they were for."""
        if self._sender is not None:
            self._sender.cancel()
            self._sender = None
        if self._part_sender is not None:
            self._part_sender.cancel()
            self._part_sender = None
        for ing in self._streams or []:
            if ing is not None:
                ing.close()
        self._streams = None
        self._close_created_sessions()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- update ---
    def _update(self, layer_obj, key_states, value_states, cache_kwargs):
        self.wait_ready()
        li = layer_obj.layer_idx
        b, h, n, d = key_states.shape
        if h != self.spec.num_kv_heads or d != self.spec.head_dim or tuple(value_states.shape) != (b, h, n, d):
            raise ValueError("layer %d: key/value states must be [B, %d, n, %d], got %s and %s"
                             % (li, self.spec.num_kv_heads, self.spec.head_dim, tuple(key_states.shape),
                                tuple(value_states.shape)))
        if self._awaiting is not None:
            raise RuntimeError("layer %d's decode attention did not go through kvshade (is the model's "
                               "attention implementation still %r?)" % (self._awaiting, ATTENTION_NAME))
        k, v = _round_to_store(key_states), _round_to_store(value_states)
        if self._decoding:
            if self._decode_mode is None:
                raise RuntimeError("this KvShadeCache was made with decode=None (prefill only): decode its "
                                   "sessions %s with a decoder of their own" % (self.session_ids,))
            if n != 1:
                raise NotImplementedError(
                    "KvShadeCache: a %d-token forward after the prompt (chunked prefill, a new turn, speculative "
                    "decoding) is not supported; make a new KvShadeCache over the whole conversation (the cached "
                    "prefix is reused)" % n)
            layer_obj.length += 1
            self._awaiting = li
            _current.entry = (self, li, k, "decode")
            return k, v
        start = layer_obj.length
        total = self._prompt_length(n, start)
        with torch.no_grad():
            pre = self._unrotate(key_states, cache_kwargs, start)
            pk = pre.to(STORE_DTYPE)                       # [B, n, h, d] pre-RoPE
            pv = v.transpose(1, 2).to(STORE_DTYPE)          # [B, n, h, d]
        if self._chunked:
            return self._update_chunk(layer_obj, k, v, pk, pv, start, total)
        if self._streams is None and self._sender is None and self._device_ingest_wanted(key_states):
            self._begin_device_ingest(n, pk.shape[0])
        if self._streams is not None and self._part_sender is not None:
            # Same node, after the first layer: handed to the sending thread with an event, so
            # that the forward goes on launching the next layers' kernels instead of waiting
            # for this layer's to finish (and for the call to the daemon) before each layer.
            parts = [(b, pk[b, self.created_all[b].reused_tokens:].contiguous(),
                      pv[b, self.created_all[b].reused_tokens:].contiguous(), 0)
                     for b, ing in enumerate(self._streams) if ing is not None]
            if parts:
                self._part_sender.put(li, parts, True)
            del pk, pv, parts
            self._pre_k[li] = self._v[li] = _TAKEN
        elif self._streams is not None:
            # Same node: the daemon reads this layer from the GPU while the model computes
            # the next one; nothing goes through host memory here. The first layer goes on
            # this thread: a daemon that cannot read this GPU's memory fails it, and "auto"
            # then takes the host path.
            self._pre_k[li], self._v[li] = pk, pv
            try:
                for b, ing in enumerate(self._streams):
                    if ing is not None:
                        r = self.created_all[b].reused_tokens
                        ing.layer_cuda(li, pk[b, r:].contiguous(), pv[b, r:].contiguous())
            except Exception as e:  # noqa: BLE001 - "auto" falls back to the host path
                self._abandon_device_ingest(e)  # sends every layer held so far, this one too
            else:
                del pk, pv
                self._sent_layers.append(li)
                self._release_taken_layers()
                if len(self._pre_k) > 1:
                    self._part_sender = _DevicePartSender(self._streams, self._ingest_window)
        else:
            # Host path: this layer goes to the daemon over the wire while the model computes
            # the next one (the sender copies it off the GPU on a stream of its own).
            if self._sender is None:
                self._begin_host_ingest(n, pk.shape[0])
            self._sender.put(li, pk, pv)
            self._pre_k[li] = self._v[li] = _SENT
        layer_obj.length = n
        if all(x is not None for x in self._pre_k):
            self._ingest(n)
        _current.entry = (self, li, k, "prefill")
        return k, v

    def _unrotate(self, key_states, cache_kwargs, start=0):
        """Post-RoPE keys [B, h, n, d] of positions start..start+n-1 -> pre-RoPE [B, n, h, d]
        float32, with the cos/sin the model applied (cache_kwargs where given, else its rotary
        embedding at those positions).
        fp32 recovers the keys to ~1e-7 relative, far inside one bf16 step, so rounding to
        bf16 gives back bf16-exact keys bit for bit."""
        n = key_states.shape[2]
        cos = sin = None
        if isinstance(cache_kwargs, dict):
            cos, sin = cache_kwargs.get("cos"), cache_kwargs.get("sin")
            cp = cache_kwargs.get("cache_position")
            if cp is not None and (cp.numel() != n or int(cp.reshape(-1)[0]) != start):
                raise NotImplementedError("KvShadeCache: this prompt forward must start at position %d (the "
                                          "tokens prefilled so far), got %d" % (start, int(cp.reshape(-1)[0])))
        if cos is None or sin is None:
            pos = torch.arange(start, start + n, device=key_states.device)[None]
            cos, sin = self.rotary(key_states, pos)
        rd = cos.shape[-1]
        # cos/sin are [1 or B, n, rd]; prompts share positions (no padding).
        c = cos.reshape(-1, n, 1, rd)[:1].float()
        s = sin.reshape(-1, n, 1, rd)[:1].float()
        k = key_states.transpose(1, 2).float()  # [B, n, h, d]
        kr, half = k[..., :rd], rd // 2
        # HF applies y = x*cos + rotate_half(x)*sin with rotate_half(x) = [-x2, x1]; its
        # inverse is (y*cos - rotate_half(y)*sin) / (cos^2 + sin^2) (the denominator is the
        # yarn magnitude squared, and absorbs cos/sin rounded to a low-precision dtype).
        rot = torch.cat([-kr[..., half:], kr[..., :half]], dim=-1)
        pre = (kr * c - rot * s) / (c * c + s * s)
        return torch.cat([pre, k[..., rd:]], dim=-1) if rd < k.shape[-1] else pre

    # --- chunked prefill ---
    def _prompt_length(self, n, start):
        """The whole prompt's length for a prefill forward of n tokens at position `start`; a
        first forward shorter than the prompt_ids given starts a chunked prefill."""
        if start == 0 and not self._chunked:
            total = len(self._prompt_ids[0]) if self._prompt_ids else n
            if n < total:
                self._chunked = True
                self._history = [[] for _ in range(self.spec.num_layers)]
            return total
        if not self._chunked:
            raise NotImplementedError("KvShadeCache: the prompt came in one forward; a further multi-token forward "
                                      "needs prompt_ids naming the whole prompt from the start (chunked prefill)")
        total = len(self._prompt_ids[0])
        if start + n > total:
            raise ValueError("KvShadeCache: a prefill chunk of %d tokens at position %d runs past the prompt's %d "
                             "tokens (prompt_ids)" % (n, start, total))
        return total

    def _update_chunk(self, layer_obj, k, v, pk, pv, start, total):
        """One layer of one chunk of a chunked prefill. The chunk's part of this layer goes to
        the daemon as it is computed: from the GPU on the same node (CUDA IPC, let go of once
        the daemon has read it: at most ingest_window_bytes held), else from host memory over
        the client's data plane. Its exact K/V go to host memory for the later chunks; the
        model attends over the earlier chunks' exact K/V, brought back to the GPU one layer
        ahead, then this chunk's: never the whole prompt's K/V on the GPU, only this layer's
        and the next one's."""
        li = layer_obj.layer_idx
        last = start + k.shape[2] == total
        if start == 0 and li == 0:
            if self._device_ingest_wanted(k):
                self._begin_device_ingest(total, pk.shape[0])
            else:
                self._begin_host_ingest(total, pk.shape[0])
        t0 = time.perf_counter()
        if self._streams is not None:
            try:
                self._send_chunk_part(li, pk, pv, start, last)
            except Exception as e:  # noqa: BLE001 - "auto" falls back to the host path
                if not (start == 0 and li == 0):
                    raise  # parts the daemon took are no longer here to send another way
                self._abandon_device_ingest(e, total, pk.shape[0])
        if self._sender is not None:
            self._sender.put(li, pk, pv, start, last)
        elif self._streams is None:
            raise RuntimeError("KvShadeCache: the chunked prefill's ingest is not open (layer %d)" % li)
        t1 = time.perf_counter()
        k_all, v_all = self._attend_kv(li, start, k, v)
        t2 = time.perf_counter()
        if not last:
            self._keep_history(li, k, v)
        t3 = time.perf_counter()
        times = self.chunk_times
        times["send"] += t1 - t0
        times["attend_kv"] += t2 - t1
        times["history"] += t3 - t2
        layer_obj.length = start + k.shape[2]
        if last:
            self._pre_k[li] = self._v[li] = _TAKEN if self._streams is not None else _SENT
            if all(x is not None for x in self._pre_k):
                self._keep_prefix()
                self._drop_history()
                self._ingest(total)
        _current.entry = (self, li, k_all, "prefill")
        return k_all, v_all

    # --- a prefix's exact K/V, kept and reused (kvshade.integrations.serving.Generator's prefix cache) ---
    def keep_prefix(self, tokens: int) -> None:
        """After this chunked prefill, keep the exact post-RoPE K/V of the prompt's first
        `tokens` tokens (in host memory, as the later chunks read them) as `kept_prefix`
        instead of dropping them; start_after_prefix() of another cache over a prompt with
        the same first tokens then skips their forward. Chunks must not straddle `tokens`
        (a chunk boundary there); a single sequence only."""
        if int(tokens) < 1:
            raise ValueError("keep_prefix: tokens must be >= 1, got %r" % (tokens,))
        self._keep_prefix_tokens = int(tokens)

    def _keep_prefix(self):
        want = self._keep_prefix_tokens
        if not want or not self._history:
            return
        if self._history_stream is not None:
            self._history_stream.synchronize()  # the history's copies to the host are done
        kept = []
        for entries in self._history:
            layer, have = [], 0
            for hk, hv in entries:
                if have >= want:
                    break
                c = min(hk.shape[2], want - have)
                layer.append((hk[:, :, :c], hv[:, :, :c]))
                have += c
            if have < want:
                return  # the prefix is not all in host memory (the prompt's last chunk): nothing kept
            kept.append(layer)
        self.kept_prefix = kept

    def start_after_prefix(self, tokens: int, kv) -> bool:
        """Starts this (not yet run) chunked prefill after its prompt's first `tokens` tokens,
        whose exact K/V are `kv` (another cache's kept_prefix over the same tokens): the first
        forward is then the prompt from position `tokens` on, attending to `kv` exactly. The
        session is created here; the daemon must reuse at least those tokens from its prefix
        cache (it holds them compressed, and they are not computed again here). Returns
        False, with nothing changed, when it does not (then prefill from position 0)."""
        if self._prompt_ids is None or len(self._prompt_ids) != 1:
            raise ValueError("start_after_prefix needs the prompt_ids of one sequence")
        total = len(self._prompt_ids[0])
        tokens = int(tokens)
        if not 0 < tokens < total or len(kv) != self.spec.num_layers:
            raise ValueError("start_after_prefix: %d tokens of a %d-token prompt, K/V of %d layers (want %d)"
                             % (tokens, total, len(kv), self.spec.num_layers))
        if self._streams is not None or self._sender is not None or self.layers[0].length:
            raise RuntimeError("start_after_prefix: the prefill has begun")
        probe = torch.empty(0, device=next(iter(self._model_params_device)))
        if self._device_ingest_wanted(probe):
            self._begin_device_ingest(total, 1)
        else:
            self._begin_host_ingest(total, 1)
        if self.created_all[0].reused_tokens < tokens:
            # The daemon no longer has them (evicted, another device): back to position 0.
            self._cancel_ingest()
            self.created_all, self.created = [], None
            return False
        self._chunked = True
        self._history = [list(layer) for layer in kv]
        for layer_obj in self.layers:
            layer_obj.length = tokens
        return True

    def _send_chunk_part(self, li, pk, pv, start, last):
        """Same node: this chunk's rows of layer li (after each sequence's reused prefix) to
        every stream from the GPU; the streams hold them until the daemon has read them, and
        the prefill waits while they hold more than ingest_window_bytes. The prompt's first
        part goes on this thread (a daemon that cannot read this GPU's memory fails it, and
        "auto" then takes the host path); the later ones through a _DevicePartSender, so
        that the forward does not wait for each layer's kernels and calls."""
        parts = []
        for b, ing in enumerate(self._streams):
            if ing is None:
                continue
            r = self.created_all[b].reused_tokens
            lo = max(0, r - start)
            if lo >= pk.shape[1]:
                continue  # inside the reused prefix
            parts.append((b, pk[b, lo:].contiguous(), pv[b, lo:].contiguous(), start + lo - r))
        if not parts:
            return
        if self._part_sender is not None:
            self._part_sender.put(li, parts, last)
            return
        for b, k, v, offset in parts:
            self._streams[b].layer_cuda(li, k, v, offset, last)
        self._part_sender = _DevicePartSender(self._streams, self._ingest_window)

    def _keep_history(self, li, k, v):
        """This chunk's exact post-RoPE keys and values [B, h, c, d] for the later chunks (bf16:
        they are bf16 values already): kept on the GPU while the history there stays within
        history_device_bytes (a later chunk then reads them at device speed), else copied to
        pinned host memory on a stream of their own."""
        kb, vb = k.to(STORE_DTYPE), v.to(STORE_DTYPE)
        size = 2 * kb.numel() * kb.element_size()
        if kb.is_cuda and self.history_bytes_on_device + size <= self._history_device_budget:
            self.history_bytes_on_device += size
            self._history[li].append((kb.clone(), vb.clone()))
            return
        if kb.is_cuda:
            stream = self._side_stream(kb.device)
            hk = torch.empty(kb.shape, dtype=STORE_DTYPE, pin_memory=True)
            hv = torch.empty(vb.shape, dtype=STORE_DTYPE, pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(kb.device))
            with torch.cuda.stream(stream):
                hk.copy_(kb, non_blocking=True)
                hv.copy_(vb, non_blocking=True)
            kb.record_stream(stream)
            vb.record_stream(stream)
        else:
            hk, hv = kb.clone(), vb.clone()
        self._history[li].append((hk, hv))

    def _side_stream(self, device):
        if self._history_stream is None:
            self._history_stream = torch.cuda.Stream(device)
        return self._history_stream

    def _fetch_history(self, li, start, like):
        """Layer li's earlier chunks' K/V into new [B, h, start + c, d] tensors of the model's
        dtype on its device (positions start.. are left for the chunk itself); on a GPU the
        copies run on the side stream, and the event says when they are done."""
        B, h, c, d = like.shape
        kf = torch.empty((B, h, start + c, d), dtype=like.dtype, device=like.device)
        vf = torch.empty_like(kf)
        event = None
        if like.is_cuda:
            stream = self._side_stream(like.device)
            stream.wait_stream(torch.cuda.current_stream(like.device))  # kf, vf are allocated
            with torch.cuda.stream(stream):
                self._copy_history(li, kf, vf)
                event = torch.cuda.Event()
                event.record(stream)
            kf.record_stream(stream)
            vf.record_stream(stream)
        else:
            self._copy_history(li, kf, vf)
        return kf, vf, event

    def _copy_history(self, li, kf, vf):
        o = 0
        for hk, hv in self._history[li]:
            c = hk.shape[2]
            kf[:, :, o:o + c].copy_(hk, non_blocking=True)
            vf[:, :, o:o + c].copy_(hv, non_blocking=True)
            o += c

    def _attend_kv(self, li, start, k, v):
        """The K/V chunk attention needs at layer li: the earlier chunks' then this one's. The
        next layer's earlier chunks start their way to the GPU now, behind this layer's
        attention."""
        if start == 0:
            return k, v
        got = self._prefetched.pop(li, None)
        if got is None or got[0].shape[2] != start + k.shape[2]:
            got = self._fetch_history(li, start, k)
        kf, vf, event = got
        if event is not None:
            torch.cuda.current_stream(k.device).wait_event(event)
        kf[:, :, start:].copy_(k)
        vf[:, :, start:].copy_(v)
        if li + 1 < self.spec.num_layers:
            self._prefetched[li + 1] = self._fetch_history(li + 1, start, k)
        return kf, vf

    def _drop_history(self):
        self._history = None
        self._prefetched = {}
        self.history_bytes_on_device = 0

    def prefill(self, model, chunk_tokens=None):
        """Runs the prompt (prompt_ids) through `model` into this cache, in forwards of at most
        chunk_tokens tokens (None: one forward), and returns the logits of its last token
        [B, vocab]. Each chunk attends to the earlier ones exactly; the GPU holds the
        forward's own memory plus two layers of the earlier chunks' K/V, never the whole
        prompt's. The sessions are ready for decode once wait_ready() returns (the first
        decode step waits for it anyway)."""
        if self._prompt_ids is None:
            raise ValueError("prefill needs prompt_ids (KvShadeCache(..., prompt_ids=ids) or set_prompt(ids))")
        if chunk_tokens is not None and int(chunk_tokens) < 1:
            raise ValueError("chunk_tokens must be >= 1 or None, got %r" % (chunk_tokens,))
        device = next(iter(self._model_params_device))
        ids = torch.tensor(self._prompt_ids, dtype=torch.long, device=device)
        n = ids.shape[1]
        step = n if chunk_tokens is None else int(chunk_tokens)
        out = None
        with torch.no_grad():
            for a in range(0, n, step):
                out = model(input_ids=ids[:, a:a + step], past_key_values=self, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def _release_taken_layers(self):
        """Device path: lets go of the prompt layers every stream's daemon side has taken, and
        waits while more than ingest_window_bytes are still held."""
        streams = [ing for ing in self._streams if ing is not None]
        per_stream = max(1, self._ingest_window // max(1, len(streams)))
        taken = min((ing.release_taken(per_stream) for ing in streams), default=len(self._sent_layers))
        for li in self._sent_layers[:taken]:
            self._pre_k[li] = self._v[li] = _TAKEN

    def _device_ingest_wanted(self, key_states):
        """Stream the prompt's layers from the GPU (same-node ingest) when the model runs on a
        GPU and ingest="device"; with ingest="auto", when decode is not "rpc" (a worker on
        another node) and the daemon runs on a GPU backend."""
        if not key_states.is_cuda or self._ingest_mode == "host":
            return False
        if self._ingest_mode == "device":
            return True
        if self._decode_mode == "rpc":
            return False
        try:
            return self._hook_args[0].stats()["backend"] == "cuda"
        except Exception:  # noqa: BLE001 - then the host path
            return False

    def _open_ingest(self, n, B):
        """Creates every sequence's session (prefix reuse decides what to ingest) and opens
        the ingest streams that layers are then written to as the prefill computes them
        (None for a sequence whose whole prompt is cached)."""
        self._check_prompt(n, B)
        client, spec, profile, worker_id = self._hook_args
        while len(self.hooks) < B:
            self.hooks.append(KvShadeKVCache(client, spec, profile, worker_id=worker_id))
        if not isinstance(self._device, str):
            self._device = session_device(client, self._device, next(iter(self._model_params_device)),
                                          same_node=self._decode_mode != "rpc")
        self.created_all = [client.create_session(spec, profile, ids, segment_ends=self._segment_ends,
                                                  device=self._device)
                            for ids in self._prompt_ids]
        self.created = self.created_all[0]
        return [client.ingest(c.session_id, spec.dtype) if c.tokens_to_ingest > 0 else None
                for c in self.created_all]

    def _begin_device_ingest(self, n, B):
        self._streams = self._open_ingest(n, B)
        if self._decode_mode in ("auto", "local"):
            _warm_local_decode(self._hook_args[0], next(iter(self._model_params_device)))

    def _begin_host_ingest(self, n, B):
        self._sender = _LayerSender(self._open_ingest(n, B), [c.reused_tokens for c in self.created_all])

    def _close_created_sessions(self):
        client = self._hook_args[0]
        for c in self.created_all:
            try:
                client.close_session(c.session_id)
            except Exception:  # noqa: BLE001 - best effort
                pass

    def _abandon_device_ingest(self, error, n=None, B=None):
        """Same-node ingest failed (e.g. the daemon is on another node): with ingest="auto"
        the prompt goes the host path instead (the layers are still on the GPU); the
        sessions the device path created are closed. With ingest="device" the error stands.
        n, B: the prompt's length and batch when no layer is held yet (a chunked prefill's
        first part)."""
        if self._ingest_mode == "device":
            raise error
        if any(x is _TAKEN for x in self._pre_k):
            # Layers the daemon took are no longer here to send another way.
            raise error
        self.ingest_error = error
        for ing in self._streams or []:
            if ing is not None:
                ing.close()
        self._close_created_sessions()  # the host path makes new ones
        self._streams = None
        self._ingest_mode = "host"
        held = [(li, k, v) for li, (k, v) in enumerate(zip(self._pre_k, self._v)) if k is not None]
        if held:
            B, n = held[0][1].shape[:2]
        self._begin_host_ingest(n, B)
        for li, k, v in held:
            self._sender.put(li, k, v)
            self._pre_k[li] = self._v[li] = _SENT

    def _check_prompt(self, n, B):
        if self._prompt_ids is None:
            raise ValueError("KvShadeCache needs the prompt's token ids: KvShadeCache(..., prompt_ids=ids) or "
                             "set_prompt(ids) before the prefill forward")
        if len(self._prompt_ids) != B:
            raise ValueError("prompt_ids has %d sequences but the prefill forward had %d" % (len(self._prompt_ids), B))
        for ids in self._prompt_ids:
            if len(ids) != n:
                raise ValueError("prompt_ids has %d tokens but the prefill forward had %d" % (len(ids), n))

    def _ingest(self, n):
        if self._prompt_ids is None:
            raise ValueError("KvShadeCache needs the prompt's token ids: KvShadeCache(..., prompt_ids=ids) or "
                             "set_prompt(ids) before the prefill forward")
        B = len(self.created_all)
        # This runs inside the prompt's last layer, before that layer's attention and MLP are
        # launched. The rest of the ingest (the last layer's transfer on the host path), the
        # commit, the attach and, on the same node, opening the decoder (mapping the daemon's
        # memory) run on a thread while the model finishes the prompt; the first decode step,
        # or any read of the cache's state, waits for them (wait_ready) and sees their errors.
        self._decoding = True  # no further prompt layer is accepted meanwhile
        self._pending = threading.Thread(target=self._finish_in_background, args=(n, B),
                                         name="kvshade-ingest", daemon=True)
        self._pending.start()

    def _finish_in_background(self, n, B):
        try:
            self._finish_ingest(n, B)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait_ready on the caller's thread
            self._pending_error = e
        finally:
            self.committed_at = time.perf_counter()

    @property
    def ready(self) -> bool:
        """Whether the prompt's last layer went through and its commit (and decoder open) has
        finished, so that wait_ready() returns at once (raising what failed, if anything)."""
        t = self._pending
        return self._decoding and (t is None or not t.is_alive())

    def wait_committed(self):
        """Blocks until the commit (and decoder open) running after the prefill has finished,
        without raising what failed: wait_ready() raises that."""
        t = self._pending
        if t is not None and t is not threading.current_thread():
            t.join()

    def wait_ready(self):
        """Blocks until the prompt is committed and the decoder is open, and raises what failed.
        After a same-node prefill these finish on a thread while the model completes the
        prompt's last layer; the first decode step and every read of the cache's state wait
        for them anyway, so calling this is only needed to time when the session is ready."""
        t = self._pending
        if t is None or t is threading.current_thread():
            return
        t.join()
        self._pending = None
        e, self._pending_error = self._pending_error, None
        if e is not None:
            raise e

    def _finish_ingest(self, n, B):
        client, spec, profile, worker_id = self._hook_args
        self.ready_times = {"started": time.perf_counter()}
        if self._part_sender is not None:
            sender, self._part_sender = self._part_sender, None
            try:
                sender.finish()  # the parts still queued go to the daemon first
            except BaseException:
                for ing in self._streams or []:
                    if ing is not None:
                        ing.close()
                self._streams = None
                self._close_created_sessions()
                raise
        self.ready_times["parts"] = time.perf_counter()
        if self._streams is not None:
            try:
                for ing in self._streams:
                    if ing is not None:
                        ing.commit()
            except Exception as e:  # noqa: BLE001 - "auto" falls back to the host path
                self._abandon_device_ingest(e)
        if self._sender is not None:
            sender, self._sender = self._sender, None
            self.host_ingest_times = sender.times
            try:
                sender.finish()  # the layers still queued, then the commit
            except BaseException:
                self._close_created_sessions()
                raise
        self.ready_times["committed"] = time.perf_counter()
        for b in range(B):
            self.hooks[b].effective_profile = self.created_all[b].effective_profile
            self.hooks[b].reused_tokens = self.created_all[b].reused_tokens
            self.hooks[b].session_id = self.created_all[b].session_id
            # The "rpc" path attaches through its RemoteDecoder; prefill only attaches nothing.
            if self._decode_mode not in ("rpc", None):
                self.hooks[b].attach(self.created_all[b].session_id, device=self._device)
        self._streams = []
        self._drop_history()
        self._pre_k = [None] * len(self._pre_k)
        self._v = [None] * len(self._v)
        self._sent_layers = []
        self._decoding = True
        self.ready_times["attached"] = time.perf_counter()
        if self._decode_mode is None:
            return
        device = next(iter(self._model_params_device))
        if self._decode_mode != "rpc":
            from ..decoders.local import LocalDecoder
            try:
                self.local = LocalDecoder(client, [h.attachment.attachment_id for h in self.hooks],
                                          backend="cuda:%d" % (device.index or 0) if device.type == "cuda" else "cpu",
                                          count_hits=self._count_hits)
            except Exception as e:  # noqa: BLE001 - reported, then the RPC path serves
                if self._decode_mode == "local":
                    raise
                self.local_error = e
        if self.local is None:
            from ..decoders.remote import RemoteDecoder
            self.remote = RemoteDecoder(client, self.session_ids, self.spec, device=device, delivery=self._delivery,
                                        worker_id=worker_id, speculate=self._speculate[0],
                                        correct_below=self._speculate[1])
        self.ready_times["decoder"] = time.perf_counter()

    def _decode_attention(self, layer, query, key, value, scaling):
        """One decode step of one layer through kvshade: [B, hq, 1, d] -> [B, 1, hq, d]."""
        b, hq, q_len, d = query.shape
        if b != len(self.hooks) or q_len != 1:
            raise ValueError("kvshade decode attention needs query [%d, hq, 1, d], got %s"
                             % (len(self.hooks), tuple(query.shape)))
        q = decode_query(query, scaling)
        if self.local is not None:
            out = attend_local(self.local, layer, q, key, value, last_layer=layer == self.spec.num_layers - 1)
            self._awaiting = None
            return out.to(query.dtype).reshape(b, 1, hq, d)
        out = self.remote.attend(layer, q, key[:, :, 0, :], value[:, :, 0, :])
        self._awaiting = None
        return out.to(query.dtype).reshape(b, 1, hq, d)
