"""How a prefill's layers reach the daemon while the forward runs (kvshade.integrations.hf_cache):
  _LayerSender        the host path (a worker whose daemon is on another node): each layer
                      copied to pinned host memory on a stream of its own, then sent, the
                      model computing the next layers meanwhile
  _PinnedPool         the pinned (K, V) pairs those copies reuse across layers and prompts,
                      bounded in bytes
  _DevicePartSender   the same-node path: parts in the model's GPU memory handed to the
                      daemon (CUDA IPC) in order, from a thread of their own
Private to the integrations; KvShadeCache drives them.
"""
import math
import queue
import threading
import time

import torch


class _PinnedPool:
    """Pinned host buffers for the host path's layer copies, one (K, V) pair per layer,
    reused across layers and prompts. Pinning fresh memory is slow (about 0.1 s per 256 MiB
    on an H200 host, 20x the copy into it, and the copier would pay it for every layer the
    sender has not yet sent), so pairs come back here once sent. At most max_bytes are held
    (at least one pair): get() waits for a pair to come back beyond that, which bounds the
    host memory a slow wire can take."""

    def __init__(self, max_bytes):
        self._max = max_bytes
        self._cv = threading.Condition()
        self._free = {}  # (shape, dtype) -> [(k, v)]
        self._bytes = 0  # held: free and lent out

    @staticmethod
    def _size(shape, dtype):
        return 2 * math.prod(shape) * torch.empty((), dtype=dtype).element_size()

    def get(self, shape, dtype):
        key = (tuple(shape), dtype)
        size = self._size(shape, dtype)
        with self._cv:
            while True:
                if self._free.get(key):
                    return self._free[key].pop()
                if self._bytes == 0 or self._bytes + size <= self._max:
                    self._bytes += size
                    break
                # Free pairs of another shape (an earlier prompt's) make room.
                other = next((k for k, lst in self._free.items() if lst), None)
                if other is not None:
                    self._free[other].pop()
                    self._bytes -= self._size(*other)
                    continue
                self._cv.wait()
        try:
            return (torch.empty(shape, dtype=dtype, pin_memory=True),
                    torch.empty(shape, dtype=dtype, pin_memory=True))
        except BaseException:
            self.forget(shape, dtype)
            raise

    def put(self, pair):
        with self._cv:
            self._free.setdefault((tuple(pair[0].shape), pair[0].dtype), []).append(pair)
            self._cv.notify_all()

    def forget(self, shape, dtype):
        """A lent pair that will not come back."""
        with self._cv:
            self._bytes -= self._size(shape, dtype)
            self._cv.notify_all()


_pinned_pool = None
_pinned_pool_lock = threading.Lock()


def _pinned():
    global _pinned_pool
    with _pinned_pool_lock:
        if _pinned_pool is None:
            _pinned_pool = _PinnedPool(_LayerSender.MAX_PINNED_HOST_BYTES)
        return _pinned_pool


class _LayerSender:
    """The host path of a prompt's ingest: sends each layer to the sequences' Ingest streams
    in layer order while the model computes the next layers. Two threads: a copier that moves
    each layer on the GPU into pinned host memory as soon as the model's stream has produced
    it (on a CUDA stream of its own, so the GPU memory is given back at once however slow
    the wire is), and a sender that hands the host copies to the streams. The prefill waits
    for neither, unless more than MAX_PENDING_GPU_BYTES of layers (at least one layer)
    still wait for their copy: then put() waits, so that a copier that cannot keep up
    costs time rather than GPU memory. The host copies come from a process-wide pool of
    pinned buffers of at most MAX_PINNED_HOST_BYTES (at least one buffer), reused once
    sent: a wire slower than the prefill makes the copier wait for a buffer, then put().
    The first error stops the sending; finish() raises it (the streams cancelled), or
    commits."""

    MAX_PENDING_GPU_BYTES = 2 << 30
    MAX_PINNED_HOST_BYTES = 4 << 30

    def __init__(self, streams, reused):
        self._streams = streams
        self._reused = reused
        self._copy_stream = None
        self._to_copy = queue.Queue()
        self._to_send = queue.Queue()
        self._pending = threading.Condition()
        self._pending_bytes = 0  # GPU bytes put but not yet copied
        self._error = None
        # Seconds copying layers off the GPU (from the moment each was produced, waits for a
        # pinned buffer included) and on the wire, and the bytes sent.
        self.times = {"copy_s": 0.0, "send_s": 0.0, "bytes": 0}
        self._copier = threading.Thread(target=self._copy_loop, name="kvshade-ingest-copy", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name="kvshade-ingest-send", daemon=True)
        self._copier.start()
        self._sender.start()

    def put(self, layer, k, v, token_offset=0, last_part=True):
        """k, v: [B, n, h, d] bf16, pre-RoPE keys and values, on the GPU or in host memory: the
        prompt's tokens [token_offset, token_offset + n) of this layer (a chunked prefill's
        part; last_part on the one that completes the layer). The copier holds GPU tensors
        (the model's allocator cannot reuse them) until copied."""
        ready, size = None, 0
        if k.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(k.device))
            size = 2 * k.numel() * k.element_size()
            with self._pending:
                self._pending.wait_for(lambda: self._pending_bytes == 0 or
                                       self._pending_bytes + size <= self.MAX_PENDING_GPU_BYTES)
                self._pending_bytes += size
        self._to_copy.put((layer, k, v, ready, size, int(token_offset), bool(last_part)))

    def _to_host(self, k, v, ready):
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(k.device)
        if k.shape != v.shape or k.dtype != v.dtype:
            raise ValueError("k and v must have the same shape and dtype, got %s %s and %s %s"
                             % (tuple(k.shape), k.dtype, tuple(v.shape), v.dtype))
        pool = _pinned()
        hk, hv = pool.get(k.shape, k.dtype)
        try:
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(ready)
                hk.copy_(k, non_blocking=True)
                hv.copy_(v, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._copy_stream)
            done.synchronize()
        except BaseException:
            pool.forget(k.shape, k.dtype)  # the copy may still be writing them: not reused
            raise
        return hk, hv

    def _copy_loop(self):
        while True:
            item = self._to_copy.get()
            if item is None:
                self._to_send.put(None)
                return
            layer, k, v, ready, size, offset, last = item
            item = None
            pooled = False
            if self._error is None and ready is not None:
                try:
                    ready.synchronize()  # the model has produced the layer: time the copy alone
                    t0 = time.perf_counter()
                    k, v = self._to_host(k, v, ready)
                    pooled = True
                    self.times["copy_s"] += time.perf_counter() - t0
                except BaseException as e:  # noqa: BLE001 - raised by finish()
                    self._error = e
            if self._error is None:
                self._to_send.put((layer, k, v, pooled, offset, last))
            elif pooled:
                _pinned().put((k, v))
            k = v = None  # the GPU tensors (or, after an error, anything) are released here
            if size:
                with self._pending:
                    self._pending_bytes -= size
                    self._pending.notify_all()

    def _send_loop(self):
        while True:
            item = self._to_send.get()
            if item is None:
                return
            layer, k, v, pooled, offset, last = item
            item = None
            if self._error is None:
                try:
                    t0 = time.perf_counter()
                    for b, ing in enumerate(self._streams):
                        if ing is None:
                            continue
                        # The stream ingests the prompt after the reused prefix (r tokens):
                        # this part's rows from there on, at their offset in that range.
                        r = self._reused[b]
                        lo = max(0, r - offset)
                        if lo >= k.shape[1]:
                            continue  # the part lies inside the reused prefix
                        # Returns once the bytes are copied out (the buffer is free).
                        ing.layer(layer, k[b, lo:], v[b, lo:], None, offset + lo - r, last)
                        self.times["bytes"] += 2 * k[b, lo:].numel() * k.element_size()
                    self.times["send_s"] += time.perf_counter() - t0
                except BaseException as e:  # noqa: BLE001 - raised by finish()
                    self._error = e
            if pooled:
                _pinned().put((k, v))
            k = v = None

    def _join(self):
        self._to_copy.put(None)
        self._copier.join()
        self._sender.join()

    def cancel(self):
        """Stops sending and cancels the streams (a prefill that did not finish)."""
        if self._error is None:
            self._error = RuntimeError("cancelled")
        self._join()
        for ing in self._streams:
            if ing is not None:
                ing.close()

    def finish(self):
        """Waits for the queued layers, then commits every stream; raises the first error."""
        self._join()
        try:
            if self._error is not None:
                raise self._error
            for ing in self._streams:
                if ing is not None:
                    ing.commit()
        finally:
            for ing in self._streams:
                if ing is not None:
                    ing.close()


class _DevicePartSender:
    """Same-node ingest of a chunked prefill, off the forward's thread: put() records an
    event on the model's stream behind a part's rows and queues them; a thread waits for
    the event, hands the rows to the daemon (Ingest.layer_cuda, CUDA IPC) and lets go of
    the parts the daemon has taken. So the forward never waits for its own kernels to
    finish, nor for the daemon's calls, per layer; it waits only while the parts queued
    here and those the daemon still reads hold more than `window` bytes of GPU memory (at
    least one part always goes through). The first error stops the sending: the next put()
    and finish() raise it."""

    def __init__(self, streams, window):
        self._streams = streams  # one Ingest (or None: nothing to ingest) per sequence
        self._window = int(window)
        self._queue = queue.Queue()
        self._state = threading.Condition()
        self._queued_bytes = 0  # put, not yet handed to the daemon
        self._held_bytes = 0    # handed to the daemon, not yet taken (as of the last check)
        self._error = None
        self._thread = threading.Thread(target=self._loop, name="kvshade-ingest-device", daemon=True)
        self._thread.start()

    def put(self, layer, parts, last):
        """parts: [(sequence, k, v, token_offset)], k and v [n, h, d] contiguous bf16 on the
        GPU, written by the current stream; last: this part completes the layer."""
        size = sum(2 * k.numel() * k.element_size() for _, k, _, _ in parts)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(parts[0][1].device))
        with self._state:
            self._state.wait_for(lambda: self._error is not None or self._queued_bytes == 0
                                 or self._queued_bytes + self._held_bytes + size <= self._window)
            if self._error is not None:
                raise self._error
            self._queued_bytes += size
        self._queue.put((layer, parts, bool(last), ready, size))

    def _loop(self):
        streams = [ing for ing in self._streams if ing is not None]
        per_stream = max(1, self._window // max(1, len(streams)))
        while True:
            item = self._queue.get()
            if item is None:
                return
            layer, parts, last, ready, size = item
            item = None
            if self._error is None:
                try:
                    for b, k, v, offset in parts:
                        self._streams[b].layer_cuda(layer, k, v, offset, last, ready=ready)
                    parts = None
                    # Lets go of what the daemon took; waits (here, not in the forward) while
                    # a stream still holds more than its share of the window.
                    for ing in streams:
                        ing.release_taken(per_stream)
                except BaseException as e:  # noqa: BLE001 - raised by put() and finish()
                    self._error = e
            parts = None
            with self._state:
                self._queued_bytes -= size
                self._held_bytes = sum(ing.held_cuda_bytes for ing in streams)
                self._state.notify_all()

    def _stop(self):
        self._queue.put(None)
        self._thread.join()
        # The thread refers to this object (its target); let go of the streams at once rather
        # than when the cycle is collected.
        self._thread = self._streams = None

    def finish(self):
        """Waits until every queued part is with the daemon; raises the first error."""
        self._stop()
        if self._error is not None:
            raise self._error

    def cancel(self):
        """Stops sending (a prefill that did not finish); the streams are closed by the caller."""
        if self._error is None:
            self._error = RuntimeError("cancelled")
        self._stop()
