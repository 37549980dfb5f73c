"""Serving long contexts through transformers' continuous batching, kvshade holding them.

    import kvshade
    from kvshade.integrations import hf_batching
    from transformers import GenerationConfig
    manager = hf_batching.enable(model, client, kvshade.Profile("shadow"),
                                 generation_config=GenerationConfig(do_sample=False, max_new_tokens=256))
    out = model.generate_batch([ids_a, ids_b], max_new_tokens=256)   # {"req_0": GenerationOutput, ...}
    # or manager.start(); rid = manager.add_request(ids, max_new_tokens=64); manager.get_result(rid) ...
    # `transformers serve` reaches the same manager through model.init_continuous_batching()
    hf_batching.disable(model)

transformers' continuous batching (ContinuousBatchingManager, generate_batch, and the
OpenAI-compatible server built on them) schedules requests itself: every forward is one
ragged batch [1, T] of prefill chunks and decode tokens of many requests (positions,
cu_seq_lens, read/write indices into its PagedAttentionCache), run by a background thread;
it samples, streams and finishes requests. kvshade changes only where each request's K/V
live and how its attention is computed:

  * Attention implementation "paged|kvshade" (`AttentionInterface.register`, the documented
    hook; `enable` switches the model to it). For each request in the forward it takes the
    request's rows of q, k, v:
      - prefill chunk: the rows go to the request's `hf_cache.KvShadeCache(decode=None)`,
        exactly as `KvShadeCache.prefill` feeds it: each chunk's layer streams to the daemon
        as it is computed (from the GPU on the same node) and attends to the earlier chunks
        exactly (their K/V wait in host memory, one layer ahead on the GPU); the prompt's
        last chunk commits the session.
      - decode token: the request's session sits in one `serving.BatchCache` (one same-node
        `LocalDecoder` for all decoding requests): the rows of every decoding request go to
        it in one batched call per layer. A request joins it at its first decode token (its
        prompt committed) and leaves it, its session closed, when it finishes.
    transformers' paged cache is never read or written: it keeps only the block accounting
    its scheduler admits requests by (`release_paged_memory` drops its tensors where their
    layout is known).
  * `KvShadeBatchingManager`, a ContinuousBatchingManager that attaches the above to the
    paged cache it creates. `enable` installs it as the model's persistent manager
    (`model._cached_continuous_batching_manager`, transformers' own mechanism for keeping a
    manager across sessions), so `generate_batch`, `init_continuous_batching` and the server
    use it unchanged.

Extension points transformers lacks, and where this adapts (all in KvShadeBatchingManager
or on the paged cache instance it created; no transformers module is patched):
  * Which request each token of a ragged forward belongs to: the attention function gets
    cu_seq_lens and read/write indices, no request ids. The batch is laid out by
    `PagedAttentionCache.extend_read_and_write_indices(request_id, past_length,
    query_length, ...)` (or `fill_block_table`, the decode fast path), called once per
    request in token order; the manager wraps these methods on its cache instance to record
    (request, past, length) for the next forward. The wrappers skip the original: its read
    indices cost O(context) Python work per request per step and nothing reads them.
  * A request-finished (or cancelled, failed) callback: none; `PagedAttentionCache.
    free_blocks(request_id)` is what the scheduler calls then, so the manager wraps it too
    (and `free_all_requests`, a reset).
  * A way to pass a cache class or factory to the manager: none (`_create_batch_processor`
    constructs PagedAttentionCache itself); the manager overrides `_create_batch_processor`
    to attach to the cache it made.
  * The prompt token ids of a request (kvshade's prefix-cache key) before its prefill:
    taken from `add_request` (overridden to record them), else from the scheduler's
    request state (`initial_tokens`).
  * A scheduler budget that is not physical memory: the paged cache is sized from free GPU
    memory (or num_blocks, checked against it), and requests are admitted by its blocks, so
    the tokens in flight stay bounded by what transformers would have held on the GPU.

Contract and limits:
  * Every request goes through kvshade (the same profile and model id for all); decode is
    same-node (`LocalDecoder`: the daemon on this node). Greedy or sampled decoding,
    logits processors, streaming, per-request max_new_tokens and eos are transformers'.
  * Settings the manager forces (`configure`): no CUDA graphs, no torch.compile, no async
    batching (the attention function runs Python per forward), no prefix block sharing
    (kvshade reuses cached prefixes itself, at CreateSession), no decode fast path, no
    automatic switch to a flash attention kernel. Refused:
    num_return_sequences > 1 (forked requests), sliding-window layers.
  * Every decoding request must be in every forward that decodes (one LocalDecoder step
    covers the whole batch). transformers' FIFO scheduler schedules decoding requests
    first; keep max_batch_tokens and max_requests_per_batch above the number of requests
    decoding at once. A forward that leaves one out fails with an error saying so.
  * A request that comes back after transformers offloaded its cache (out of blocks) is
    failed: its prefill state here is gone. Size the paged cache so that it does not run
    out (its tensors cost nothing here once released).
  * Generated tokens stay exact in the decoder's local tail (at most local_capacity per
    request), as in kvshade.integrations.serving.

Written against transformers 5.x continuous batching (ContinuousBatchingConfig,
`_create_batch_processor`); the method names it hooks are checked when the manager
attaches, with an error naming what is missing.
"""
import copy
import inspect
import itertools
import logging
import threading
import traceback
from typing import Dict, List, Optional

import torch

from . import hf_cache, serving

try:
    from transformers import AttentionInterface
    try:
        from transformers.generation.continuous_batching import ContinuousBatchingManager
    except ImportError:
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
except ImportError as e:
    raise ImportError("kvshade.integrations.hf_batching needs transformers with continuous batching "
                      "(transformers.generation.continuous_batching.ContinuousBatchingManager): %s" % e) from e
try:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
except ImportError:  # older 5.x: these settings live on the GenerationConfig
    ContinuousBatchingConfig = None

log = logging.getLogger("kvshade.integrations.hf_batching")

ATTENTION_NAME = hf_cache.PAGED_ATTENTION_NAME  # "paged|kvshade"
_ATTR = "_kvshade_batching"  # on an attached PagedAttentionCache: its KvShadeBatching

# ContinuousBatchingConfig settings the kvshade attention needs (set where the field exists).
FORCED_SETTINGS = {
    "allow_block_sharing": False,
    "use_cuda_graph": False,
    "use_async_batching": False,
    "varlen_compile_config": None,
    "decode_compile_config": None,
    "default_compile_level": 0,
    "max_blocks_per_request": 0,
    "auto_switch_to_flash": False,  # would swap "paged|kvshade" for a flash kernel
}


# --- The attention function ----------------------------------------------------------------------

def paged_kvshade_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The "paged|kvshade" attention function: query [1, hq, T, d], key/value [1, h, T, d]
    of one ragged continuous-batching forward -> ([1, T, hq, d], None). Without transformers'
    `cache` argument (a plain forward, e.g. generate with a KvShadeCache) it is the
    "kvshade" function."""
    cache = kwargs.get("cache")
    if cache is None:
        return hf_cache.kvshade_attention(module, query, key, value, attention_mask, scaling=scaling,
                                          dropout=dropout, **kwargs)
    batching = getattr(cache, _ATTR, None)
    if batching is None:
        raise RuntimeError("attention %r got a %s that kvshade did not attach to: serve through "
                           "kvshade.integrations.hf_batching.enable(model, client, profile) (its manager attaches to the paged "
                           "cache it creates)" % (ATTENTION_NAME, type(cache).__name__))
    if kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise ValueError("%s: sliding_window/softcap are not supported" % ATTENTION_NAME)
    return batching.attention(module, query, key, value, scaling), None


def register():
    """Registers "paged|kvshade" (and "kvshade") with transformers, with sdpa's mask
    function (idempotent)."""
    hf_cache.register()
    AttentionInterface.register(ATTENTION_NAME, paged_kvshade_attention)
    hf_cache.register_sdpa_mask(ATTENTION_NAME)


register()


# --- Per-forward bookkeeping -----------------------------------------------------------------------

class _Request:
    """One request kvshade holds: its prefill cache until the prompt is committed, then its
    sequence in the decode batch."""
    __slots__ = ("id", "prompt", "prefill", "prefilled", "session_id", "reused_tokens", "joined")

    def __init__(self, rid, prompt, prefill):
        self.id = rid
        self.prompt = prompt
        self.prefill = prefill  # hf_cache.KvShadeCache(decode=None) until the session joins
        self.prefilled = 0  # prompt tokens given to the prefill so far
        self.session_id = None
        self.reused_tokens = 0
        self.joined = False


def _arg(args, kwargs, i, name):
    return args[i] if len(args) > i else kwargs[name]


def _wrap(obj, name, hook, call_original):
    """Shadows obj.name (a bound method) on this instance with one that calls hook(*args)
    first, then the original unless call_original is False. Returns whether it existed."""
    orig = getattr(obj, name, None)
    if not callable(orig):
        return False
    orig = getattr(orig, "__wrapped__", orig)  # attached again: wrap the original once

    def wrapper(*args, **kwargs):
        hook(*args, **kwargs)
        return orig(*args, **kwargs) if call_original else None

    wrapper.__wrapped__ = orig
    setattr(obj, name, wrapper)
    return True


def release_paged_memory(paged_cache):
    """Replaces the paged cache's K/V tensors (the `key_cache` / `value_cache` lists of
    transformers' PagedAttentionCache) with views of one row each, same shape, dtype and
    device, so that their memory is given back; anything that still wrote to them would
    fail loudly. Returns the bytes released (0 where the layout is not that one)."""
    released = 0
    for name in ("key_cache", "value_cache"):
        tensors = getattr(paged_cache, name, None)
        if not isinstance(tensors, list):
            continue
        for i, t in enumerate(tensors):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] > 1 and t.stride(0) != 0:
                released += t.numel() * t.element_size()
                tensors[i] = t.new_zeros((1,) + tuple(t.shape[1:])).expand(t.shape)
    if released and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return released


class KvShadeBatching:
    """What the "paged|kvshade" attention function serves a continuous-batching forward with:
    per request a prefill cache, then a sequence in one decode batch (see the module doc).

    client, model, profile: as for hf_cache.KvShadeCache (one profile for every request)
    model_id      : the prefix-cache namespace (default: the model's name; a fresh id for a
                    model without one)
    local_capacity: tokens each request may decode (the decoder's local tail)
    close_sessions: close each request's session when it finishes (default True)
    cache_kwargs  : more arguments for each request's hf_cache.KvShadeCache
    release_paged_memory: give back the paged cache's tensors when attaching (default True)
    device        : the daemon device of the requests' sessions, as hf_cache.KvShadeCache's
                    (None: the model's GPU among the daemon's devices, found once; a str as
                    is, "" = the daemon's first device); the decode batch attaches with it
    """

    def __init__(self, client, model, profile, model_id=None, worker_id="kvshade-hf-batching", local_capacity=1024,
                 close_sessions=True, cache_kwargs=None, count_hits=False, release_paged_memory=True, device=None):
        self.client, self.model, self.profile = client, model, profile
        if model_id is None:
            model_id = hf_cache.model_id_of(model, "hf-batching-%x" % id(model))
        self.model_id = model_id
        self.worker_id = worker_id
        self.close_sessions = close_sessions
        self.cache_kwargs = dict(cache_kwargs or {})
        if "device" in self.cache_kwargs:
            raise ValueError("cache_kwargs must not hold 'device': pass device= (the decode batch and every "
                             "request's cache share it)")
        self.release_paged_memory = release_paged_memory
        self.batch = serving.BatchCache(client, model, model_id=model_id, worker_id=worker_id,
                                        local_capacity=local_capacity, count_hits=count_hits, device=device)
        # Every request's cache places its session where the batch decodes: no lookup per request.
        self.cache_kwargs["device"] = self.batch.session_device
        self.num_layers = self.batch.num_layers
        self._requests: Dict[str, _Request] = {}
        self._by_session: Dict[str, _Request] = {}
        self._prompts: Dict[str, List[int]] = {}  # from add_request, until the first forward
        self._prompts_lock = threading.Lock()
        self._pending = []  # (request_id, past_length, query_length) recorded for the next forward
        self._plan = None  # this forward's: ([(request, a, b)] prefill rows, decode row index or None)
        self._scheduler = None
        self.paged_cache = None
        self.paged_bytes_released = 0
        self.errors: List[str] = []  # tracebacks of what failed in a forward or a finish
        self.sessions_served: List[str] = []
        self.stats = {"requests": 0, "finished": 0, "forwards": 0, "decode_steps": 0, "prefill_chunks": 0,
                      "max_batch": 0, "max_spread": 0}

    # --- Attaching to transformers' paged cache ---
    def attach(self, paged_cache, scheduler=None):
        """Hooks the paged cache transformers just created (see the module doc): records each
        forward's layout and each request's end. Requests of an earlier cache are let go."""
        self.release_all()
        recorders = [n for n in ("extend_read_and_write_indices", "fill_block_table") if hasattr(paged_cache, n)]
        if not recorders and hasattr(paged_cache, "extend_write_indices"):
            recorders = ["extend_write_indices"]  # older layout: read and write indices apart
            _wrap(paged_cache, "extend_read_indices", lambda *a, **k: None, call_original=False)
        if not recorders:
            raise RuntimeError("%s has none of extend_read_and_write_indices / extend_write_indices / "
                               "fill_block_table: kvshade.integrations.hf_batching cannot tell which request each token of a "
                               "forward belongs to" % type(paged_cache).__name__)
        for name in recorders:
            _wrap(paged_cache, name, self._record, call_original=False)
        if not _wrap(paged_cache, "free_blocks", self._finished, call_original=True):
            raise RuntimeError("%s has no free_blocks(request_id): kvshade.integrations.hf_batching cannot tell when a request "
                               "ends" % type(paged_cache).__name__)
        _wrap(paged_cache, "free_all_requests", lambda *a, **k: self.release_all(), call_original=True)
        setattr(paged_cache, _ATTR, self)
        self.paged_cache, self._scheduler = paged_cache, scheduler
        if self.release_paged_memory:
            self.paged_bytes_released = release_paged_memory(paged_cache)

    def add_prompt(self, request_id, input_ids):
        """The prompt of a request about to be queued (ContinuousBatchingManager.add_request)."""
        ids = hf_cache.KvShadeCache._ids(input_ids)
        if len(ids) != 1:
            raise ValueError("a request has one prompt, got %d" % len(ids))
        with self._prompts_lock:
            self._prompts[request_id] = ids[0]

    def _prompt_of(self, rid):
        with self._prompts_lock:
            prompt = self._prompts.pop(rid, None)
        if prompt is not None:
            return prompt
        sched = self._scheduler
        for table in ("active_requests", "waiting_requests"):
            state = getattr(sched, table, {}).get(rid) if sched is not None else None
            for name in ("initial_tokens", "prompt_ids", "full_prompt_ids"):
                ids = getattr(state, name, None)
                if ids:
                    return [int(t) for t in ids]
        raise RuntimeError("request %s: its prompt is unknown (it was not queued through the kvshade manager's "
                           "add_request, and the scheduler's state has no initial_tokens)" % rid)

    # --- transformers' hooks ---
    def _record(self, *args, **kwargs):
        self._pending.append((_arg(args, kwargs, 0, "request_id"), int(_arg(args, kwargs, 1, "past_length")),
                              int(_arg(args, kwargs, 2, "query_length"))))

    def _finished(self, *args, **kwargs):
        rid = _arg(args, kwargs, 0, "request_id")
        with self._prompts_lock:
            self._prompts.pop(rid, None)
        req = self._requests.pop(rid, None)
        if req is None:
            return
        self.stats["finished"] += 1
        try:
            self._let_go(req)
        except Exception:  # noqa: BLE001 - the request is over either way; kept for the caller
            self.errors.append(traceback.format_exc())
            log.exception("kvshade: releasing request %s failed", rid)

    def _let_go(self, req):
        if req.joined:
            self._by_session.pop(req.session_id, None)
            self.batch.leave(req.session_id, close_session=self.close_sessions)
        elif req.prefill is not None:
            kc, req.prefill = req.prefill, None
            if req.prefilled < len(req.prompt):
                kc.close(close_session=True)  # never committed
            else:
                sid, _ = serving.ready_session(kc)  # done at its first token: never joined
                self.sessions_served.append(sid)
                if self.close_sessions:
                    self.client.close_session(sid)

    def release_all(self):
        """Lets go of every request (their sessions closed with close_sessions) and of what was
        recorded for a forward that did not run."""
        for rid in list(self._requests):
            self._finished(rid)
        with self._prompts_lock:
            self._prompts.clear()
        self._pending = []
        self._plan = None

    def close(self):
        """release_all(), then frees the decoder."""
        self.release_all()
        self.batch.close(close_sessions=self.close_sessions)

    @property
    def active(self) -> int:
        """Requests holding a prefill cache or a decode sequence."""
        return len(self._requests)

    # --- One forward ---
    def _admit(self, rid, past):
        if past != 0:
            raise RuntimeError("request %s first reached kvshade at position %d: its earlier tokens were not "
                               "prefilled here (prefix block sharing on, or its cache was offloaded and restored)"
                               % (rid, past))
        prompt = self._prompt_of(rid)
        kc = hf_cache.KvShadeCache(self.client, self.model, self.profile, prompt_ids=prompt, model_id=self.model_id,
                                   worker_id=self.worker_id, decode=None, **self.cache_kwargs)
        req = _Request(rid, prompt, kc)
        self._requests[rid] = req
        self.stats["requests"] += 1
        return req

    def _join(self, req):
        kc, req.prefill = req.prefill, None
        req.session_id, req.reused_tokens = serving.ready_session(kc)
        self.sessions_served.append(req.session_id)
        try:
            self.batch.join(req.session_id)
        except BaseException:
            if self.close_sessions:
                self.client.close_session(req.session_id)
            raise
        req.joined = True
        self._by_session[req.session_id] = req

    def _begin_forward(self, tokens, device):
        plan, self._pending = self._pending, []
        if sum(q for _, _, q in plan) != tokens:
            raise RuntimeError("%s: the forward has %d tokens but its requests %d (padded inputs: CUDA graphs or "
                               "compile are on, see hf_batching.configure)"
                               % (ATTENTION_NAME, tokens, sum(q for _, _, q in plan)))
        prefill, decode, at = [], {}, 0
        for rid, past, q in plan:
            req = self._requests.get(rid) or self._admit(rid, past)
            n = len(req.prompt)
            if past < n:
                if req.prefill is None or past != req.prefilled or past + q > n:
                    raise RuntimeError("request %s: a prefill forward of tokens [%d, %d) after %d of its %d prompt "
                                       "tokens" % (rid, past, past + q, req.prefilled, n))
                prefill.append((req, at, at + q))
                req.prefilled = past + q
                self.stats["prefill_chunks"] += 1
            else:
                if q != 1:
                    raise RuntimeError("request %s: %d tokens in one decode forward (speculative decoding is not "
                                       "supported)" % (rid, q))
                if not req.joined:
                    self._join(req)
                decode[rid] = (at, past)
            at += q
        index = None
        if decode:
            rows = []
            for seq in self.batch.sequences:
                req = self._by_session[seq.session_id]
                if req.id not in decode:
                    raise RuntimeError("request %s is decoding but this forward left it out (%d of %d decoding "
                                       "requests scheduled): one LocalDecoder step covers every decoding request; "
                                       "raise max_batch_tokens / max_requests_per_batch"
                                       % (req.id, len(decode), self.batch.batch))
                row, past = decode[req.id]
                if seq.length != past:
                    raise RuntimeError("request %s decodes position %d but its session holds %d tokens"
                                       % (req.id, past, seq.length))
                rows.append(row)
            index = torch.tensor(rows, dtype=torch.long, device=device)
            pos = [s.length for s in self.batch.sequences]
            self.stats["decode_steps"] += 1
            self.stats["max_batch"] = max(self.stats["max_batch"], len(rows))
            self.stats["max_spread"] = max(self.stats["max_spread"], max(pos) - min(pos))
        self.stats["forwards"] += 1
        self._plan = (prefill, index)

    def attention(self, module, query, key, value, scaling):
        """One layer of one forward: [1, hq, T, d] -> [1, T, hq, d]."""
        layer = int(module.layer_idx)
        try:
            if layer == 0:
                self._begin_forward(query.shape[2], query.device)
            elif self._plan is None:
                raise RuntimeError("layer %d of a forward whose layer 0 did not go through %s" % (layer, ATTENTION_NAME))
            prefill, index = self._plan
            _, hq, t, d = query.shape
            out = query.new_empty((1, t, hq, d))
            for req, a, b in prefill:
                out[:, a:b] = self._prefill_attention(req, layer, module, query, key, value, a, b, scaling)
            if index is not None:
                q = query[0][:, index].transpose(0, 1).unsqueeze(2)  # [B, hq, 1, d]
                k = key[0][:, index].transpose(0, 1).unsqueeze(2)  # [B, h, 1, d]
                v = value[0][:, index].transpose(0, 1).unsqueeze(2)
                out[0, index] = self.batch.attend(layer, q, k, v, scaling)[:, 0].to(out.dtype)
            if layer == self.num_layers - 1:
                self._plan = None
            return out
        except BaseException:
            self._plan = None
            self.errors.append(traceback.format_exc())
            raise

    def _prefill_attention(self, req, layer, module, query, key, value, a, b, scaling):
        """A request's prefill rows [a, b) of one layer: into its KvShadeCache (to the daemon),
        attending to its earlier chunks and causally within the chunk -> [1, b - a, hq, d]."""
        kc, n = req.prefill, b - a
        k_all, v_all = kc.layers[layer].update(key[:, :, a:b], value[:, :, a:b])
        hf_cache._current.entry = None  # kvshade_attention is not called for it here
        start = k_all.shape[2] - n
        mask = None
        if start:
            cols = torch.arange(start + n, device=query.device)
            rows = torch.arange(start, start + n, device=query.device)
            mask = (cols[None, :] <= rows[:, None])[None, None]
        out, _ = kc.prefill_attention(module, query[:, :, a:b], k_all, v_all, mask, scaling=scaling, dropout=0.0)
        return out


# --- The manager -----------------------------------------------------------------------------------

class KvShadeBatchingManager(ContinuousBatchingManager):
    """A ContinuousBatchingManager whose requests kvshade holds (see the module doc); made by
    `enable`. kvshade: the KvShadeBatching it attaches to each paged cache it creates."""

    _ids = itertools.count()

    def __init__(self, model, *args, kvshade: KvShadeBatching, **kwargs):
        self.kvshade = kvshade
        super().__init__(model, *args, **kwargs)
        self.warmed_up = True  # nothing to capture: the kvshade attention runs outside CUDA graphs

    def warmup(self):
        """Nothing to warm up (no CUDA graphs, no compile)."""
        self.warmed_up = True

    def _create_batch_processor(self):
        processor = super()._create_batch_processor()
        self.kvshade.attach(processor.cache, getattr(processor, "scheduler", None))
        return processor

    def add_request(self, input_ids, request_id=None, *args, **kwargs):
        if request_id is None:
            request_id = "kvshade_%d" % next(self._ids)
        self.kvshade.add_prompt(request_id, input_ids)
        return super().add_request(input_ids, request_id, *args, **kwargs)

    def stop(self, *args, **kwargs):
        out = super().stop(*args, **kwargs)
        if not self.is_running():
            self.kvshade.release_all()  # requests the loop did not finish: sessions closed
        return out

    def close(self):
        """Stops the manager and frees kvshade's decoder; the model keeps no manager."""
        if self.is_running():
            self.stop(block=True)
        self.kvshade.close()
        if getattr(self.model, "_cached_continuous_batching_manager", None) is self:
            del self.model._cached_continuous_batching_manager


def configure(continuous_batching_config=None, **settings):
    """A ContinuousBatchingConfig for kvshade: a copy of the one given (or a default one),
    with `settings` applied, then FORCED_SETTINGS where the field exists (CUDA graphs,
    compile, async batching, prefix block sharing and the decode fast path off). A setting
    this transformers' config does not have raises a ValueError."""
    if ContinuousBatchingConfig is None:
        if continuous_batching_config is not None or settings:
            raise ValueError("this transformers has no ContinuousBatchingConfig: give the settings on the "
                             "GenerationConfig")
        return None
    cb = copy.deepcopy(continuous_batching_config) if continuous_batching_config is not None \
        else ContinuousBatchingConfig()
    for name, value in settings.items():
        if not hasattr(cb, name):
            raise ValueError("ContinuousBatchingConfig has no %r" % name)
        setattr(cb, name, value)
    for name, value in FORCED_SETTINGS.items():
        if hasattr(cb, name):
            setattr(cb, name, value)
    return cb


def _use_paged_kvshade(model):
    register()
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        try:
            setter(ATTENTION_NAME)
        except Exception as e:  # noqa: BLE001 - then set it as transformers' own manager does
            log.info("set_attn_implementation(%r) failed (%s); setting config._attn_implementation", ATTENTION_NAME, e)
    for config in {id(model.config): model.config, id(hf_cache._text_config(model.config)):
                   hf_cache._text_config(model.config)}.values():
        if getattr(config, "_attn_implementation", None) != ATTENTION_NAME:
            config._attn_implementation = ATTENTION_NAME
    hf_cache.require_attention(model)


def enable(model, client, profile, generation_config=None, continuous_batching_config=None, **kwargs):
    """Serves `model`'s continuous batching through kvshade: registers "paged|kvshade",
    switches the model to it and installs a KvShadeBatchingManager as its persistent manager,
    which `model.generate_batch`, `model.init_continuous_batching` (and so `transformers
    serve`) return from then on. Returns the manager (not started: generate_batch starts and
    stops it; for add_request, start() it).

    generation_config: the manager's (default the model's); do_sample, logits processors and
        the default max_new_tokens / eos come from it (a later generate_batch's own
        generation_config is not used: the persistent manager keeps this one)
    continuous_batching_config: passed through `configure`
    kwargs: KvShadeBatching's (model_id, local_capacity, close_sessions, cache_kwargs, device, ...)
    """
    gen = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    if (getattr(gen, "num_return_sequences", None) or 1) != 1:
        raise ValueError("num_return_sequences=%r: forked requests are not supported by kvshade.integrations.hf_batching"
                         % gen.num_return_sequences)
    if getattr(gen, "eos_token_id", None) is None:
        gen.eos_token_id = -1  # as init_continuous_batching does: no end token
    cb = configure(continuous_batching_config)
    disable(model)
    _use_paged_kvshade(model)
    batching = KvShadeBatching(client, model, profile, **kwargs)
    params = inspect.signature(ContinuousBatchingManager.__init__).parameters
    manager_kwargs = {"generation_config": gen}
    if cb is not None:
        if "continuous_batching_config" not in params:
            raise TypeError("this transformers' ContinuousBatchingManager takes no continuous_batching_config")
        manager_kwargs["continuous_batching_config"] = cb
    try:
        manager = KvShadeBatchingManager(model, kvshade=batching, **manager_kwargs)
    except BaseException:
        batching.close()
        raise
    model._cached_continuous_batching_manager = manager
    return manager


def disable(model):
    """Stops and removes the model's kvshade manager (its requests' sessions closed, its
    decoder freed). The model stays on "paged|kvshade" (which serves hf_cache caches too)."""
    manager = getattr(model, "_cached_continuous_batching_manager", None)
    if isinstance(manager, KvShadeBatchingManager):
        manager.close()


def manager_of(model) -> Optional[KvShadeBatchingManager]:
    """The model's kvshade manager, or None."""
    manager = getattr(model, "_cached_continuous_batching_manager", None)
    return manager if isinstance(manager, KvShadeBatchingManager) else None
