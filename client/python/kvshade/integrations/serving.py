"""Serving long contexts with transformers: continuous batching over kvshade sessions.

    import kvshade
    from kvshade.integrations import hf_cache, serving
    hf_cache.enable(model)
    gen = serving.Generator(client, model, kvshade.Profile("shadow"), max_batch=48)
    req = gen.submit(prompt_ids, max_new_tokens=128)
    while gen.busy:
        for done in gen.step():          # the requests that finished in this step
            print(done.id, done.tokens)

Two pieces, each usable alone:
  * `BatchCache`, a transformers Cache for decode steps of a batch of ready kvshade sessions
    that changes between steps: `join(session_id)` adds a sequence (any length, any prompt),
    `leave(i)` drops one and frees its decoder memory at once. One `kvshade.decoders.local.LocalDecoder`
    (same node, no RPC per step) serves the whole batch; each sequence keeps its own
    positions (`position_ids()`), and `decode(model, tokens)` runs one model forward of one
    token per sequence.
  * `Generator`, a scheduler over it: requests wait in arrival order; between decode steps
    it prefills up to `prefills_per_step` of them (each prompt through
    `hf_cache.KvShadeCache(decode=None)`: its layers stream to the daemon during the prefill
    and leave the GPU as soon as the daemon took them), picks the first token, and joins the
    session to the batch at the first step after its commit finished (the batch does not
    wait for a commit, nor for the join's calls to the daemon and its mapping: they run on
    a thread of the request's own, BatchCache.prepare_join); a request that reached
    max_new_tokens or an end token leaves the batch in the same step. It records, per request, the time to the first token
    and each later token's time.

One decoder batches sessions of one geometry, profile and value codec: with the server's
value_codec "auto" (int4 from int4_from_tokens prompt tokens, bf16 below) a request whose
prompt resolves another codec than the batch's ends with finish_reason "error" (its error
says why) and the others go on; give the profile an explicit value_codec to mix lengths.

Shared prefixes (prefix_cache_device_bytes, prefix_cache_bytes): a request's segment_ends
mark the end of a shared part of its prompt (a document before its question); the
Generator keeps that part's exact K/V after its prefill (on the GPU within its budget, else
in host memory), and a later request over the same part (which the daemon
reuses too) is prefilled from the part's end only (Request.prefill_skipped). Such a
request waits in the queue while the request that kept the part is still committing (the
daemon registers the part at that commit); the batch decodes meanwhile instead of waiting
in the step.

A prompt is prefilled in one forward, which stalls the batch's decode steps meanwhile, or
with `prefill_chunk_tokens` in chunks of that many tokens, one chunk per prefill forward
between decode steps (each chunk attends to the earlier ones exactly: see
hf_cache.KvShadeCache.prefill), so that a long prompt delays the running sequences by one
chunk's forward per step instead of its whole prefill. With `decode_stall` (e.g. 1.5) the
chunk is sized each step so that, while sequences decode, a step that also runs a prefill
chunk takes about that many times a plain decode step (measured as it goes; at most
prefill_chunk_tokens, at least MIN_STALL_CHUNK tokens): the running sequences' time per
output token stays even, and a long prompt's prefill takes more, smaller forwards while
others decode (the whole prefill_chunk_tokens when none does).

Devices: on a daemon that serves several GPUs (docs/OPERATIONS.md "Devices") the sessions
go to the model's GPU (`device=`: see hf_cache.KvShadeCache; found once, when the BatchCache
is made), and `join` refuses a session on another of the daemon's devices
(FailedPrecondition naming both): the decoder reads a session's state from its GPU.

Limits: generated tokens stay exact in the decoder's local tail (at most
`local_capacity` per sequence; they are not appended to the sessions); greedy decoding
unless a `sampler` is given. Same-node decode only (the daemon on this node).
"""
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import hf_cache
from ..client import Client, Profile
from ..errors import FailedPrecondition, KvShadeError
from ..decoders.local import LocalDecoder, PreparedSequence
from ..routing import session_device

# A `device=` of the adapters: the daemon's name of a device (str), or a GPU of this process
# (torch.device, int); kvshade.routing.session_device.
DeviceArg = Union[str, int, torch.device]

try:
    from transformers.cache_utils import Cache, DynamicLayer
except ImportError as e:  # hf_cache raised the clear error already; keep the names defined
    raise ImportError("kvshade.integrations.serving needs transformers (see kvshade.integrations.hf_cache): %s" % e) from e

# The smallest prefill chunk decode_stall sizes (a forward of fewer tokens pays the model's
# weights for too little work), and the granularity of its chunk sizes.
MIN_STALL_CHUNK = 128
_STALL_ROUND = 64


class _BatchLayer(hf_cache.KvShadeCacheLayer):
    """One model layer of a BatchCache: no tensors; its length is the batch's longest
    sequence (what transformers sizes masks and cache positions from; the kvshade attention
    ignores the mask, every sequence attends its own session). The rest is
    KvShadeCacheLayer's."""

    def __init__(self, owner, layer_idx):
        DynamicLayer.__init__(self)
        self._owner = owner
        self.layer_idx = layer_idx

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._owner._update(self.layer_idx, key_states, value_states)

    def _tokens(self):
        return self._owner.max_length

    def _refuse(self, what):
        raise NotImplementedError("BatchCache does not support %s: sequences join() and leave() between "
                                  "decode steps" % what)

    def reset(self, *args, **kwargs):
        self._refuse("reset")

    def batch_select_indices(self, indices):
        self._refuse("batch_select_indices (use leave())")


@dataclass
class _Sequence:
    session_id: str
    attachment_id: str
    length: int  # tokens before the next decode token: the session's, then one per step
    decoded: int = 0  # decode steps in this batch (tokens in the decoder's local tail)


class BatchCache(Cache):
    """Decode steps of a changing batch of ready kvshade sessions, one token per sequence per
    forward, through one same-node LocalDecoder (see the module doc).

    client   : kvshade.Client of the daemon on this node
    model    : the transformers model (`hf_cache.enable(model)` first)
    model_id : when given, join() refuses sessions of another model id (their K/V came from
               other weights)
    local_capacity: tokens each sequence may decode in this batch (the decoder's local tail)
    device   : the daemon device of this worker's sessions, as hf_cache.KvShadeCache's (None:
               the model's GPU among the daemon's devices; a str as is, "" = unchecked);
               `session_device` is the str the daemon is given (join attaches with it)
    """

    def __init__(self, client: Client, model: torch.nn.Module, model_id: Optional[str] = None,
                 worker_id: str = "kvshade-serving", local_capacity: int = 1024, count_hits: bool = False,
                 device: Optional[DeviceArg] = None) -> None:
        config = hf_cache.require_attention(model)
        self.client = client
        self.model_id = model_id
        self.worker_id = worker_id
        self.num_layers = config.num_hidden_layers
        self.device = next(model.parameters()).device
        self.session_device = session_device(client, device, self.device, same_node=True)
        backend = "cuda:%d" % (self.device.index or 0) if self.device.type == "cuda" else "cpu"
        self.decoder = LocalDecoder(client, [], backend=backend, local_capacity=local_capacity,
                                    count_hits=count_hits)
        self.local_capacity = int(local_capacity)
        self.sequences: List[_Sequence] = []
        self._awaiting = None
        self._positions: Optional[torch.Tensor] = None  # [B, 1] int64 on the model's device, rebuilt after each change
        super().__init__(layers=[_BatchLayer(self, i) for i in range(self.num_layers)])

    # --- The batch ---
    @property
    def batch(self) -> int:
        return len(self.sequences)

    @property
    def max_length(self) -> int:
        return max((s.length for s in self.sequences), default=0)

    @property
    def session_ids(self) -> List[str]:
        return [s.session_id for s in self.sequences]

    def join(self, session_id: str) -> int:
        """Adds a ready session at the end of the batch (between steps); returns its index."""
        return self.join_prepared(self.prepare_join(session_id))

    def prepare_join(self, session_id: str) -> "PreparedJoin":
        """join()'s calls to the daemon and its mapping (the session checked, an attachment
        made, the decoder's LocalDecoder.prepare), which may run on another thread than the
        steps' (the Generator runs them while the batch decodes); join_prepared() then adds
        the session between steps, or release() lets it go."""
        info = self.client.get_session(session_id)
        if info["state"] != "ready":
            raise FailedPrecondition("session %s is %s, not ready" % (session_id, info["state"]))
        if self.model_id is not None and info["model_id"] != self.model_id:
            raise FailedPrecondition("session %s holds K/V of model %r, not %r" % (session_id, info["model_id"],
                                                                                   self.model_id))
        att = self.client.attach(session_id, self.worker_id, device=self.session_device or None)
        try:
            sequence = self.decoder.prepare(att.attachment_id)
        except BaseException:
            self.client.detach(att.attachment_id)
            raise
        return PreparedJoin(session_id, att.attachment_id, int(info["tokens"]), sequence)

    def join_prepared(self, prepared: "PreparedJoin") -> int:
        """Adds a session prepared by prepare_join() at the end of the batch (between steps);
        returns its index. On failure the attachment is released."""
        try:
            index = self.decoder.join(prepared.sequence)
        except BaseException:
            self.release(prepared)
            raise
        self.sequences.append(_Sequence(prepared.session_id, prepared.attachment_id, prepared.tokens))
        self._positions = None
        return index

    def release(self, prepared: "PreparedJoin") -> None:
        """Lets go of a prepared join's attachment (the session stays open)."""
        prepared.sequence.close()
        self.client.detach(prepared.attachment_id)

    def leave(self, sequence: Union[int, str], close_session: bool = False) -> None:
        """Drops a sequence (batch index or session id) between steps: its decoder memory is
        freed at once, its attachment released (and its session closed with close_session);
        later sequences move down one index."""
        i = self.session_ids.index(sequence) if isinstance(sequence, str) else int(sequence)
        if not 0 <= i < len(self.sequences):
            raise IndexError("sequence %s is not in the batch of %d" % (sequence, len(self.sequences)))
        seq = self.sequences[i]
        self.decoder.leave(i)
        del self.sequences[i]
        self._positions = None
        try:
            self.client.detach(seq.attachment_id)
        finally:
            if close_session:
                self.client.close_session(seq.session_id)

    def position_ids(self) -> torch.Tensor:
        """[B, 1] positions of the next decode token of each sequence (pass as position_ids)."""
        if self._positions is None:
            self._positions = torch.tensor([[s.length] for s in self.sequences], dtype=torch.long,
                                           device=self.device)
        return self._positions

    def decode(self, model, tokens: torch.Tensor, **kwargs) -> torch.Tensor:
        """One decode step of the whole batch: tokens [B] (each sequence's newest token) ->
        logits [B, vocab] of the next token."""
        if self.batch == 0:
            raise FailedPrecondition("the batch is empty: join() a session first")
        tokens = tokens.reshape(-1)
        if tokens.numel() != self.batch:
            raise ValueError("decode needs one token per sequence (%d), got %d" % (self.batch, tokens.numel()))
        full = [s.session_id for s in self.sequences if s.decoded >= self.local_capacity]
        if full:
            raise FailedPrecondition("sequences %s decoded local_capacity (%d) tokens in this batch"
                                     % (full, self.local_capacity))
        try:
            with torch.no_grad():
                out = model(input_ids=tokens.to(self.device)[:, None], position_ids=self.position_ids(),
                            past_key_values=self, use_cache=True, **kwargs)
        except BaseException:
            # A step that failed part-way is not advanced: the next one writes its tokens
            # at the same places.
            self._awaiting = None
            raise
        return out.logits[:, -1]

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: Optional[float] = None) -> torch.Tensor:
        """One layer of one decode step of the whole batch, for a forward this cache does not
        run itself (kvshade.integrations.hf_batching): query [B, hq, 1, d], key/value [B, h, 1, d] post-RoPE
        in batch order -> [B, 1, hq, d]. The model's last layer ends the step (every sequence
        one token longer)."""
        if query.shape[0] != self.batch or key.shape[0] != self.batch:
            raise ValueError("layer %d: %d queries for a batch of %d" % (layer, query.shape[0], self.batch))
        if layer == 0:
            full = [s.session_id for s in self.sequences if s.decoded >= self.local_capacity]
            if full:
                raise FailedPrecondition("sequences %s decoded local_capacity (%d) tokens in this batch"
                                         % (full, self.local_capacity))
        k, v = hf_cache._round_to_store(key), hf_cache._round_to_store(value)
        return self._decode_attention(layer, query, k, v, scaling)

    def close(self, close_sessions: bool = False) -> None:
        """Leaves every sequence (closing their sessions with close_sessions) and frees the decoder."""
        while self.sequences:
            self.leave(len(self.sequences) - 1, close_session=close_sessions)
        self.decoder.close()

    # --- transformers hooks ---
    def _update(self, layer, key_states, value_states):
        b, _, n, _ = key_states.shape
        if n != 1:
            raise NotImplementedError("BatchCache decodes one token per sequence per forward, got %d: prefill "
                                      "through hf_cache.KvShadeCache(decode=None) and join() the session" % n)
        if b != self.batch:
            raise ValueError("layer %d: the forward has %d sequences, the batch %d" % (layer, b, self.batch))
        if self._awaiting is not None:
            raise RuntimeError("layer %d's decode attention did not go through kvshade (is the model's "
                               "attention implementation still %r?)" % (self._awaiting, hf_cache.ATTENTION_NAME))
        k, v = hf_cache._round_to_store(key_states), hf_cache._round_to_store(value_states)
        self._awaiting = layer
        hf_cache._current.entry = (self, layer, k, "decode")
        return k, v

    def _decode_attention(self, layer, query, key, value, scaling):
        b, hq, _, d = query.shape
        last = layer == self.num_layers - 1
        out = hf_cache.attend_local(self.decoder, layer, hf_cache.decode_query(query, scaling), key, value,
                                    last_layer=last)
        self._awaiting = None
        if last:
            for s in self.sequences:
                s.length += 1
                s.decoded += 1
            self._positions = None
        return out.to(query.dtype).reshape(b, 1, hq, d)


def _to_host(kept):
    """Per-layer [(k, v)] copied into pinned host memory."""
    def host(t):
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t)
        return out
    return [[(host(k), host(v)) for k, v in layer] for layer in kept]


def ready_session(kc: "hf_cache.KvShadeCache") -> Tuple[str, int]:
    """The session of a prefill-only hf_cache.KvShadeCache (decode=None, one sequence) once
    its prompt is committed: waits for the commit, lets go of the cache (the session stays
    open) and returns (session_id, reused_tokens). If the commit failed, the session is
    closed and the error raised."""
    try:
        kc.wait_ready()
        session_id, reused = kc.session_ids[0], kc.created.reused_tokens
    except BaseException:
        kc.close(close_session=True)
        raise
    kc.close()
    return session_id, reused


@dataclass
class PreparedJoin:
    """A session checked and attached for a BatchCache (BatchCache.prepare_join), not yet in it."""
    session_id: str
    attachment_id: str
    tokens: int
    sequence: PreparedSequence  # the decoder's part (LocalDecoder.prepare)


class _Committing:
    """A prefilled request whose session is committing: on a thread of its own, waits for the
    commit, then makes the batch's calls to the daemon and maps the session for it
    (BatchCache.prepare_join), so that the step that joins it only adds it to the batch.
    `ready` once that thread is done."""

    def __init__(self, cache: "BatchCache", req: "Request", kc: "hf_cache.KvShadeCache") -> None:
        self.req, self.kc = req, kc
        self.session: Optional[Tuple[str, int]] = None  # (session_id, reused_tokens) once committed
        self.prepared: Optional[PreparedJoin] = None
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(cache,), name="kvshade-serving-join",
                                        daemon=True)
        self._thread.start()

    def _run(self, cache: "BatchCache") -> None:
        try:
            self.session = ready_session(self.kc)
            if not self.req.done:  # decided at the first token, before this thread started
                t0 = time.perf_counter()
                self.prepared = cache.prepare_join(self.session[0])
                self.req.prepare_s = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - handed to the step that admits it
            self.error = e

    @property
    def ready(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()


@dataclass
class StepRecord:
    """One Generator.step: when it started (time.perf_counter()), its seconds in all and in
    its parts, what it carried."""
    started: float
    seconds: float
    admit_s: float  # joining the requests whose sessions got ready (and, with nothing
    # decoding or prefilling, waiting for the oldest one's commit)
    prefill_s: float  # prefill forwards (and their first tokens)
    decode_s: float  # the batch's decode step
    batch: int  # sequences decoded
    joined: int  # sequences that joined the batch
    prefill_tokens: int  # tokens through prefill forwards


@dataclass
class Request:
    """One generation request and what happened to it (times from time.perf_counter())."""
    id: int
    prompt: List[int]
    max_new_tokens: int
    eos_token_ids: Sequence[int] = ()
    tokens: List[int] = field(default_factory=list)
    submitted_at: float = 0.0
    token_times: List[float] = field(default_factory=list)  # when each token was picked
    session_id: Optional[str] = None
    finish_reason: Optional[str] = None  # "length", "eos" or "error" once done
    error: Optional[BaseException] = None  # why it ended with "error"
    reused_tokens: int = 0  # prompt tokens the daemon reused from its prefix cache
    prefill_skipped: int = 0  # prompt tokens not run through the model (a kept prefix's K/V)
    segment_ends: Sequence[int] = ()  # where the daemon cuts the prompt into cached segments
    commit_s: Optional[float] = None  # from the first token to the end of its session's commit
    join_s: Optional[float] = None  # the step's join of its session (adding it to the batch)
    prepare_s: Optional[float] = None  # the calls to the daemon and the mapping for the join, on
    # the request's own thread after the commit (the batch decodes meanwhile)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def ttft(self) -> Optional[float]:
        """Seconds from submit() to the first token."""
        return self.token_times[0] - self.submitted_at if self.token_times else None

    @property
    def tpot(self) -> List[float]:
        """Seconds between consecutive tokens (time per output token)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


class Generator:
    """Continuous batching of generation requests over kvshade sessions (see the module doc).

    client, model, profile: as for hf_cache.KvShadeCache (one profile for every request)
    max_batch       : the most sequences decoding together
    prefills_per_step: the most prefill forwards between two decode steps (a whole prompt each,
                      or one chunk each with prefill_chunk_tokens)
    prefill_chunk_tokens: prefill each prompt in chunks of at most this many tokens, one chunk
                      per prefill forward (None: a whole prompt per forward)
    model_id        : the prefix-cache namespace (default: the model's name; a fresh id for a
                      model without one), shared by every request so that shared prompt
                      prefixes are reused
    sampler         : logits [B, vocab] -> tokens [B] (default greedy)
    close_sessions  : close each request's session when it finishes (default True)
    cache_kwargs    : more arguments for each prompt's hf_cache.KvShadeCache
    prefix_cache_bytes: host memory for the exact K/V of shared prompt prefixes (the requests'
                      segment_ends: a document before its questions), least recently used
                      first out. A request whose prompt starts with a kept prefix that the
                      daemon also still caches is prefilled from the prefix's end: the
                      forward over the prefix is not run again (its K/V are read back, one
                      layer ahead, for the rest of the prompt's attention)
    prefix_cache_device_bytes: GPU memory for kept prefixes (read back at device speed
                      rather than over the host link; the least recently used move to host
                      memory when they do not fit). Both 0: no prefix cache
    history_device_bytes: GPU memory for each chunked prefill's earlier chunks
                      (hf_cache.KvShadeCache history_device_bytes; a kept prefix stays where
                      its prefill held it). Counted with the model's own memory: with 8 GiB
                      of each, a worker holds at most 16 GiB of exact K/V beside its batch
    device          : the daemon device of the requests' sessions, as hf_cache.KvShadeCache's
                      (None: the model's GPU among the daemon's devices), found once
    decode_stall    : with prefill_chunk_tokens, while sequences decode, size each prefill
                      chunk so that a step carrying it takes about this many times a plain
                      decode step (> 1; one prefill forward per such step); the chunk
                      follows the measured step times, between MIN_STALL_CHUNK and
                      prefill_chunk_tokens. None: every chunk is prefill_chunk_tokens
    """

    def __init__(self, client: Client, model: torch.nn.Module, profile: Profile, max_batch: int = 64,
                 prefills_per_step: int = 1, model_id: Optional[str] = None, worker_id: str = "kvshade-serving",
                 local_capacity: int = 1024, sampler: Optional[Callable] = None, close_sessions: bool = True,
                 cache_kwargs: Optional[Dict[str, Any]] = None, prefill_chunk_tokens: Optional[int] = None,
                 prefix_cache_bytes: int = 8 << 30, device: Optional[DeviceArg] = None,
                 decode_stall: Optional[float] = None, prefix_cache_device_bytes: int = 8 << 30,
                 history_device_bytes: int = 8 << 30) -> None:
        if max_batch < 1 or prefills_per_step < 1:
            raise ValueError("max_batch and prefills_per_step must be >= 1")
        if decode_stall is not None:
            if not float(decode_stall) > 1.0:
                raise ValueError("decode_stall must be > 1 or None, got %r" % (decode_stall,))
            if prefill_chunk_tokens is None:
                raise ValueError("decode_stall sizes prefill chunks: it needs prefill_chunk_tokens")
        self.decode_stall = None if decode_stall is None else float(decode_stall)
        # decode_stall's state: a plain decode step's seconds (moving average; None until one
        # ran) and the chunk size it chose last.
        self._decode_s: Optional[float] = None
        self._stall_chunk: Optional[int] = None
        if prefill_chunk_tokens is not None and int(prefill_chunk_tokens) < 1:
            raise ValueError("prefill_chunk_tokens must be >= 1 or None, got %r" % (prefill_chunk_tokens,))
        self.prefill_chunk_tokens = None if prefill_chunk_tokens is None else int(prefill_chunk_tokens)
        for name, value in (("prefix_cache_bytes", prefix_cache_bytes),
                            ("prefix_cache_device_bytes", prefix_cache_device_bytes),
                            ("history_device_bytes", history_device_bytes)):
            if int(value) < 0:
                raise ValueError("%s must be >= 0, got %r" % (name, value))
        self.prefix_cache_bytes = int(prefix_cache_bytes)
        self.prefix_cache_device_bytes = int(prefix_cache_device_bytes)
        self._prefix_cache_on = self.prefix_cache_bytes + self.prefix_cache_device_bytes > 0
        self.history_device_bytes = int(history_device_bytes)
        # Exact K/V of shared prefixes: {prefix tokens (tuple): (per-layer K/V, bytes, on the
        # GPU)}, oldest use first; and their bytes in host memory and on the GPU.
        self._prefixes: "OrderedDict[tuple, tuple]" = OrderedDict()
        self.prefix_bytes = 0
        self.prefix_device_bytes = 0
        # The prompt being prefilled chunk by chunk: (request, its KvShadeCache, ids, next position).
        self._prefilling: Optional[list] = None
        hf_cache.enable(model)
        self.client, self.model, self.profile = client, model, profile
        if model_id is None:
            model_id = hf_cache.model_id_of(model, "hf-serving-%x" % id(model))
        self.model_id = model_id
        self.max_batch, self.prefills_per_step = int(max_batch), int(prefills_per_step)
        self.worker_id = worker_id
        self.sampler = sampler or (lambda logits: logits.argmax(dim=-1))
        self.close_sessions = close_sessions
        self.cache_kwargs = dict(cache_kwargs or {})
        if "device" in self.cache_kwargs:
            raise ValueError("cache_kwargs must not hold 'device': pass device= to the Generator (its decode batch "
                             "and every prompt's cache share it)")
        self.cache = BatchCache(client, model, model_id=model_id, worker_id=worker_id,
                                local_capacity=local_capacity, device=device)
        # Every prompt's cache places its session where the batch decodes: no lookup per prompt.
        self.cache_kwargs["device"] = self.cache.session_device
        self.waiting: List[Request] = []
        self.running: List[Request] = []  # in batch order
        # Prefilled requests (first token picked) whose sessions are committing: (request,
        # its KvShadeCache); each joins the batch at the first step after its commit ended.
        self._committing: List[_Committing] = []
        # The chunked prefills' own work by phase, summed over every prompt prefilled so far
        # (hf_cache.KvShadeCache.chunk_times).
        self.chunk_times: Dict[str, float] = {}
        # Tokens of each of the last 10,000 prefill forwards, and whether sequences were
        # decoding meanwhile (what decode_stall sized, for a benchmark to report).
        self.prefill_forwards: Deque[Tuple[int, bool]] = deque(maxlen=10000)
        # The last 10,000 steps: StepRecord each (what a step's time went to).
        self.steps: Deque[StepRecord] = deque(maxlen=10000)
        self._prefill_tokens = 0  # tokens through prefill forwards so far
        self._next_id = 0

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self._prefilling or self._committing)

    def submit(self, prompt_ids, max_new_tokens: int, eos_token_id=None, segment_ends=()) -> Request:
        """Queues a request: prompt_ids [n] (list or tensor); returns its Request. segment_ends:
        where the daemon cuts the prompt into separately cached segments (e.g. the end of a
        shared document), passed to Client.create_session."""
        prompt = [int(t) for t in (prompt_ids.reshape(-1).tolist() if isinstance(prompt_ids, torch.Tensor)
                                   else prompt_ids)]
        if not prompt:
            raise ValueError("the prompt is empty")
        if not 1 <= int(max_new_tokens) <= self.cache.local_capacity + 1:
            raise ValueError("max_new_tokens must be in [1, local_capacity + 1 = %d], got %r"
                             % (self.cache.local_capacity + 1, max_new_tokens))
        eos = () if eos_token_id is None else (tuple(eos_token_id) if isinstance(eos_token_id, (list, tuple))
                                               else (int(eos_token_id),))
        req = Request(self._next_id, prompt, int(max_new_tokens), eos, submitted_at=time.perf_counter(),
                      segment_ends=tuple(int(e) for e in segment_ends))
        self._next_id += 1
        self.waiting.append(req)
        return req

    def _pick(self, req, token):
        req.tokens.append(int(token))
        req.token_times.append(time.perf_counter())
        if int(token) in req.eos_token_ids:
            req.finish_reason = "eos"
        elif len(req.tokens) >= req.max_new_tokens:
            req.finish_reason = "length"

    def _prefill_begin(self, req):
        """The request's prompt cache (its layers stream to the daemon during the prefill),
        started after the longest shared prefix whose exact K/V are kept here (and which the
        daemon reuses), and asked to keep the longest one that is not."""
        ids = torch.tensor([req.prompt], dtype=torch.long, device=self.cache.device)
        kwargs = dict(self.cache_kwargs)
        kwargs.setdefault("history_device_bytes", self.history_device_bytes)
        if req.segment_ends:
            kwargs["segment_ends"] = req.segment_ends
        kc = hf_cache.KvShadeCache(self.client, self.model, self.profile, prompt_ids=req.prompt,
                                   model_id=self.model_id, worker_id=self.worker_id, decode=None, **kwargs)
        at = 0
        ends = [e for e in req.segment_ends if 0 < e < len(req.prompt)] if self._prefix_cache_on else []
        for end in sorted(ends, reverse=True):
            kept = self._prefixes.get(tuple(req.prompt[:end]))
            if kept is None:
                continue
            # The daemon registers a prefix's segment at its session's commit: wait for the
            # commits still running of the requests that share it.
            for other in self._committing:
                if other.req.prompt[:end] == req.prompt[:end]:
                    other.kc.wait_committed()  # its error, if any, is raised when it is admitted
            try:
                started = kc.start_after_prefix(end, kept[0])
            except BaseException:
                kc.close(close_session=True)
                raise
            if started:
                self._prefixes.move_to_end(tuple(req.prompt[:end]))
                at = req.prefill_skipped = end
            break
        new = [e for e in ends if e > at and tuple(req.prompt[:e]) not in self._prefixes]
        if new:
            kc.keep_prefix(max(new))
        return [req, kc, ids, at]

    def _awaits_commit(self, req) -> bool:
        """Whether the prefill of req would start by waiting for another request's commit:
        the longest shared prefix of its prompt kept here is that of a request whose session
        is still committing (the daemon registers the prefix at that commit; see
        _prefill_begin). The step then decodes instead of blocking on it."""
        if not self._prefix_cache_on:
            return False
        for end in sorted((e for e in req.segment_ends if 0 < e < len(req.prompt)), reverse=True):
            if tuple(req.prompt[:end]) not in self._prefixes:
                continue
            return any(not c.kc.ready and c.req.prompt[:end] == req.prompt[:end] for c in self._committing)
        return False

    def _chunk_tokens(self) -> Optional[int]:
        """The next prefill forward's most tokens: prefill_chunk_tokens, or with decode_stall
        and sequences decoding, the size the step times call for."""
        if self.decode_stall is None or self.prefill_chunk_tokens is None or not self.running:
            return self.prefill_chunk_tokens
        if self._stall_chunk is None or self._decode_s is None:
            # No plain decode step measured yet: start small.
            self._stall_chunk = min(MIN_STALL_CHUNK, self.prefill_chunk_tokens)
        return self._stall_chunk

    def _note_step(self, seconds: float, chunk: Optional[int]) -> None:
        """decode_stall's measurements: a plain decode step (chunk None) updates the decode
        time; a step that ran a chunk of at most `chunk` tokens beside the decode scales the
        next chunk by how far the step's prefill part was from its share."""
        if self.decode_stall is None or self.prefill_chunk_tokens is None:
            return
        if chunk is None:
            self._decode_s = seconds if self._decode_s is None else 0.8 * self._decode_s + 0.2 * seconds
            return
        if self._decode_s is None:
            return
        budget = (self.decode_stall - 1.0) * self._decode_s  # the prefill part's share
        spent = seconds - self._decode_s
        factor = 2.0 if spent <= 0 else min(2.0, max(0.5, budget / spent))
        size = int(chunk * factor) // _STALL_ROUND * _STALL_ROUND
        self._stall_chunk = max(min(MIN_STALL_CHUNK, self.prefill_chunk_tokens),
                                min(self.prefill_chunk_tokens, size))

    def _next_chunk_end(self, req, at, n, chunk=None):
        """Where the prefill forward from `at` ends: the prompt's end, or `chunk` tokens on
        (None: the prompt's end), and never past a segment end (a kept prefix ends on a
        chunk boundary)."""
        end = n if chunk is None else min(n, at + chunk)
        if self._prefix_cache_on:
            end = min([end] + [e for e in req.segment_ends if at < e < end])
        return end

    def _keep_prefix(self, req, kc):
        """The exact K/V of the longest new shared prefix the prefill kept, into the prefix
        cache: on the GPU (where the prefill's history_device_bytes left them) while kept
        prefixes there fit prefix_cache_device_bytes, the least recently used moved to host
        memory to make room; in host memory up to prefix_cache_bytes, the least recently used
        dropped."""
        kept, kc.kept_prefix = kc.kept_prefix, None
        if kept is None:
            return
        size = sum(2 * k.numel() * k.element_size() for layer in kept for k, _ in layer)
        if size > max(self.prefix_cache_bytes, self.prefix_cache_device_bytes):
            return
        tokens = sum(k.shape[2] for k, _ in kept[0])
        key = tuple(req.prompt[:tokens])
        if key in self._prefixes:
            return
        on_gpu = all(k.is_cuda for layer in kept for k, _ in layer)
        if on_gpu and size <= self.prefix_cache_device_bytes:
            for old_key in list(self._prefixes):
                if self.prefix_device_bytes + size <= self.prefix_cache_device_bytes:
                    break
                if self._prefixes[old_key][2]:
                    self._prefix_to_host(old_key)
        elif size > self.prefix_cache_bytes:
            return
        else:
            kept, on_gpu = (_to_host(kept) if on_gpu else kept), False
        self._prefixes[key] = (kept, size, on_gpu)
        if on_gpu:
            self.prefix_device_bytes += size
        else:
            self.prefix_bytes += size
        self._trim_host_prefixes()

    def _prefix_to_host(self, key):
        """A kept prefix moved from the GPU to host memory (keeping its place in the order)."""
        kept, size, _ = self._prefixes[key]
        self._prefixes[key] = (_to_host(kept), size, False)
        self.prefix_device_bytes -= size
        self.prefix_bytes += size

    def _trim_host_prefixes(self):
        while self.prefix_bytes > self.prefix_cache_bytes:
            old_key = next(k for k, e in self._prefixes.items() if not e[2])
            _, old, _ = self._prefixes.pop(old_key)
            self.prefix_bytes -= old

    def _prefill_advance(self, state, chunk=None):
        """One prefill forward of the prompt in `state` (all of it, or its next chunk of
        prefill_chunk_tokens); after the last one, its first token is picked and its session
        commits in the background (_admit_committed joins it to the batch once ready).
        chunk: the forward's most tokens (None: the rest of the prompt). Returns whether the
        prompt's forwards are done."""
        req, kc, ids, at = state
        n = ids.shape[1]
        end = self._next_chunk_end(req, at, n, chunk)
        self.prefill_forwards.append((end - at, bool(self.running)))
        self._prefill_tokens += end - at
        try:
            with torch.no_grad():
                out = self.model(input_ids=ids[:, at:end], past_key_values=kc, use_cache=True, logits_to_keep=1)
            state[3] = end
            if end < n:
                return False
            token = self.sampler(out.logits[:, -1])[0]
        except BaseException:
            kc.close(close_session=True)
            raise
        for phase, seconds in kc.chunk_times.items():
            self.chunk_times[phase] = self.chunk_times.get(phase, 0.0) + seconds
        self._keep_prefix(req, kc)
        self._pick(req, token)
        self._committing.append(_Committing(self.cache, req, kc))
        return True

    def _admit_committed(self, finished, block=False):
        """Joins to the batch the requests whose sessions finished committing (with block, waits
        for the oldest first); a request already done (its first token was its last) is
        finished instead. A failed commit ends its request with finish_reason "error". The
        commit and the batch's calls to the daemon for the session ran on the request's own
        thread (_Committing); the step adds the prepared session to the decoder's batch.
        Returns how many joined."""
        keep, joined = [], 0
        for i, c in enumerate(self._committing):
            if not (c.ready or (block and i == 0)):
                keep.append(c)
                continue
            c.wait()
            req, kc = c.req, c.kc
            try:
                if kc.committed_at is not None and req.token_times:
                    req.commit_s = kc.committed_at - req.token_times[0]
                if c.session is not None:
                    req.session_id, req.reused_tokens = c.session
                if c.error is not None:
                    raise c.error
                if c.prepared is not None:
                    t0 = time.perf_counter()
                    self.cache.join_prepared(c.prepared)
                    req.join_s = time.perf_counter() - t0
            except KvShadeError as e:
                req.finish_reason, req.error = "error", e
            except BaseException as e:
                req.finish_reason, req.error = "error", e
                self._committing = keep + self._committing[i + 1:]
                self._finish(req, None)
                raise
            if req.done:
                self._finish(req, None)
                finished.append(req)
            else:
                self.running.append(req)
                joined += 1
        self._committing = keep
        return joined

    def step(self) -> List[Request]:
        """Joins the requests whose sessions have committed, prefills waiting ones (first token,
        then the commit in the background), then one decode step of the batch; returns the requests that finished in this step. With prefill_chunk_tokens a
        long prompt is prefilled over several steps, one chunk per prefill forward, so that
        the running sequences keep decoding meanwhile."""
        finished: List[Request] = []
        started = time.perf_counter()
        joined = self._admit_committed(finished)
        admitted = time.perf_counter()
        prefill_tokens = self._prefill_tokens
        forwards = 0
        chunk = self._chunk_tokens()
        # With decode_stall, one prefill forward per step while sequences decode.
        limit = 1 if self.decode_stall is not None and self.running else self.prefills_per_step
        while ((self._prefilling is not None or self.waiting) and forwards < limit
               and len(self.running) + len(self._committing) < self.max_batch):
            if self._prefilling is None and self.running and self._awaits_commit(self.waiting[0]):
                break  # its shared prefix is still committing: decode meanwhile, start it later
            req = self._prefilling[0] if self._prefilling is not None else self.waiting.pop(0)
            forwards += 1
            try:
                if self._prefilling is None:
                    self._prefilling = self._prefill_begin(req)
                if not self._prefill_advance(self._prefilling, chunk):
                    continue
                self._prefilling = None
                continue  # committing: joins the batch once its session is ready
            except KvShadeError as e:
                # This request cannot be served (e.g. its session resolved another value
                # codec than the batch's: value_codec "auto" picks by prompt length); the
                # others go on.
                self._prefilling = None
                req.finish_reason, req.error = "error", e
            except BaseException as e:
                # Anything else (e.g. the GPU out of memory in the prefill) stops the step;
                # the request says why.
                self._prefilling = None
                req.finish_reason, req.error = "error", e
                self._finish(req, None)
                raise
            self._finish(req, None)
            finished.append(req)
        prefilled = time.perf_counter()
        if not self.running and self._committing and not forwards:
            joined += self._admit_committed(finished, block=True)  # nothing else to do meanwhile
            waited = time.perf_counter() - prefilled
            admitted, prefilled = admitted + waited, prefilled + waited  # the wait counts as admitting
        batch = len(self.running)
        prefill_tokens = self._prefill_tokens - prefill_tokens
        if self.running:
            last = torch.tensor([r.tokens[-1] for r in self.running], dtype=torch.long)
            tokens = self.sampler(self.cache.decode(self.model, last)).tolist()
            self._note_step(time.perf_counter() - started, chunk if forwards else None)
            for req, t in zip(self.running, tokens):
                self._pick(req, t)
            for i in reversed(range(len(self.running))):
                if self.running[i].done:
                    req = self.running.pop(i)
                    self._finish(req, i)
                    finished.append(req)
        done = time.perf_counter()
        self.steps.append(StepRecord(started, done - started, admitted - started, prefilled - admitted,
                                     done - prefilled, batch, joined, prefill_tokens))
        return finished

    def _finish(self, req, index):
        if index is not None:
            self.cache.leave(index, close_session=self.close_sessions)
        elif self.close_sessions and req.session_id is not None:
            self.client.close_session(req.session_id)

    def run(self) -> List[Request]:
        """Steps until no request waits or runs; returns every request finished, in order."""
        out = []
        while self.busy:
            out.extend(self.step())
        return out

    def close(self) -> None:
        """Frees the batch (closing the running requests' sessions with close_sessions) and a
        prompt still being prefilled (its session closed)."""
        if self._prefilling is not None:
            self._prefilling[1].close(close_session=True)
            self._prefilling = None
        for c in self._committing:
            c.wait()
            if c.prepared is not None:
                try:
                    self.cache.release(c.prepared)
                except KvShadeError:
                    pass  # the session is closed next, its attachments with it
            if c.session is not None:
                self.client.close_session(c.session[0])  # never joined: closed as before its commit
            else:
                c.kc.close(close_session=True)
        self._committing = []
        self._prefixes.clear()  # the kept prefixes' memory
        self.prefix_bytes = self.prefix_device_bytes = 0
        self.running.clear()
        self.cache.close(close_sessions=self.close_sessions)
