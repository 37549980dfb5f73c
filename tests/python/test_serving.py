"""kvshade.integrations.serving and the bounded prefill of kvshade.integrations.hf_cache, with a tiny random Llama
(the model of test_hf_adapter) and a real kvshade-server.

  * Generator (continuous batching): requests of different prompt lengths and lengths of
    output join and leave one decode batch; each request's greedy tokens equal those of
    the same prompt decoded alone (hf_cache.KvShadeCache, same-node decode, same shadow
    profile: the same selection); sequences of different lengths decode in one batch;
    every finished request's session is closed.
  * BatchCache: refusals (an empty batch, a session that is unknown, of another model or of
    the exact profile (nothing to decode same-node), a multi-token forward).
  * Devices (a daemon of two CPU devices for a CPU model, of two GPUs on a machine with
    two): a Generator's sessions go to the model's device, and its batch refuses a session
    on the other device.
  * The device path (daemon on the cuda backend only: KVSHADE_TEST_BACKEND=cuda): with a
    window of one layer, the prompt's layers leave the GPU as the daemon takes them (never
    more than the window plus the newest layer held), and the tokens are unchanged; layers
    sent by CUDA IPC are this process's memory again once committed and dropped.

Skipped without transformers (Debian has none); KVSHADE_REQUIRE_GPU=1 makes that a failure.

    cd tests/python && KVSHADE_SERVER=... KVSHADE_LIB=... KVSHADE_TEST_BACKEND=cuda \
        KVSHADE_TEST_HEAD_DIM=64 python3 -m unittest -v test_serving
"""
import os
import unittest

import kvshade_testutil  # noqa: F401  (puts client/python on sys.path)

import kvshade
from test_hf_adapter import D, H, HAVE_TRANSFORMERS, LAYERS, REQUIRE_GPU, WHY, WithServerAndSeed

if HAVE_TRANSFORMERS:  # test_hf_adapter defines these only where transformers imports
    import torch

    from kvshade.integrations import hf_cache, serving
    from test_hf_adapter import DEV, Bf16DynamicCache, tiny_llama

BACKEND = os.environ.get("KVSHADE_TEST_BACKEND", "cpu")


_WithServer = WithServerAndSeed  # a daemon, a client and a seed per class (transformers required)


@unittest.skipUnless(HAVE_TRANSFORMERS or REQUIRE_GPU, WHY)
class ServingTest(_WithServer):
    def prompt(self, n):
        return torch.randint(3, 97, (n,), generator=self.gen).tolist()

    @staticmethod
    def profile():
        return kvshade.Profile("shadow", rank=16, chunk_size=8, sparse_budget=6, outliers=2, local_window=32)

    def reference(self, model, prompt, steps, name, segment_ends=()):
        """Greedy tokens of the prompt decoded alone through kvshade: a KvShadeCache (same-node
        decode) and one model forward per token, as the Generator runs the model, under a
        model id of its own (ingested afresh)."""
        hf_cache.enable(model)
        kc = hf_cache.KvShadeCache(self.client, model, self.profile(), prompt_ids=prompt, decode="local",
                                   model_id="serving-ref-%s-%d" % (name, self.seed), segment_ends=segment_ends)
        tokens = []
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt], device=DEV), past_key_values=kc,
                           use_cache=True).logits[0, -1]
            for _ in range(steps):
                tokens.append(int(logits.argmax()))
                logits = model(input_ids=torch.tensor([[tokens[-1]]], device=DEV), past_key_values=kc,
                               use_cache=True).logits[0, -1]
        self.assertIsNotNone(kc.local, kc.local_error)
        kc.close(close_session=True)
        return tokens

    def test_continuous_batching_equals_each_request_alone(self):
        model = tiny_llama(self.seed)
        lengths, outs = [150, 230, 96, 310], [6, 9, 4, 7]
        prompts = [self.prompt(n) for n in lengths]
        refs = [self.reference(model, p, s, "cb%d" % i) for i, (p, s) in enumerate(zip(prompts, outs))]
        gen = serving.Generator(self.client, model, self.profile(), max_batch=2,
                                model_id="serving-test-%d" % self.seed)
        reqs = [gen.submit(p, s) for p, s in zip(prompts, outs)]
        batches, spread = [], 0
        while gen.busy:
            gen.step()
            batches.append(gen.cache.batch)
            if gen.cache.batch > 1:
                pos = gen.cache.position_ids().reshape(-1).tolist()
                spread = max(spread, max(pos) - min(pos))
        for r, ref in zip(reqs, refs):
            self.assertTrue(r.done)
            self.assertEqual(r.finish_reason, "length")
            self.assertEqual(r.tokens, ref, "request %d (prompt %d tokens)" % (r.id, len(r.prompt)))
            self.assertEqual(len(r.token_times), len(r.tokens))
            self.assertGreater(r.ttft, 0)
        # The batch changed between steps: two sequences of different lengths decoded together,
        # and it never held more than max_batch.
        self.assertEqual(max(batches), 2)
        self.assertGreater(spread, 0)
        self.assertEqual(batches[-1], 0)
        for r in reqs:
            with self.assertRaises(kvshade.errors.NotFound):
                self.client.get_session(r.session_id)
        gen.close()

    def test_chunked_prefill_keeps_the_batch_decoding(self):
        # With prefill_chunk_tokens a long prompt is prefilled over several steps, one chunk
        # per step, while the running request keeps getting a token every step; both
        # requests' tokens equal each one decoded alone.
        model = tiny_llama(self.seed)
        short, long_ = self.prompt(96), self.prompt(330)
        refs = [self.reference(model, short, 12, "chunk-short"), self.reference(model, long_, 4, "chunk-long")]
        gen = serving.Generator(self.client, model, self.profile(), max_batch=2, prefill_chunk_tokens=64,
                                model_id="serving-chunked-%d" % self.seed)
        a = gen.submit(short, 12)
        while not gen.running:  # a is prefilled (two chunks) and decodes
            gen.step()
        b = gen.submit(long_, 4)
        steps_prefilling = 0
        while gen.busy:
            before = len(a.tokens)
            prefilling = gen._prefilling is not None or b in gen.waiting
            gen.step()
            if prefilling and gen._prefilling is not None:
                steps_prefilling += 1
            if prefilling and before < 12:
                # a decoded in every step that prefilled b, the one of b's last chunk too (b's
                # commit does not hold the batch up)
                self.assertEqual(len(a.tokens), before + 1)
        self.assertEqual(steps_prefilling, 330 // 64)  # chunks before the one that completes it
        self.assertEqual(a.tokens, refs[0])
        self.assertEqual(b.tokens, refs[1])
        # The Generator's record of its steps: every prefill token, both joins (each prepared
        # on its request's thread), the parts within the step's time.
        self.assertEqual(sum(r.prefill_tokens for r in gen.steps), 96 + 330)
        self.assertEqual(sum(r.joined for r in gen.steps), 2)
        self.assertLessEqual(max(r.batch for r in gen.steps), 2)
        for r in gen.steps:
            self.assertLessEqual(r.admit_s + r.prefill_s + r.decode_s, r.seconds + 1e-6)
        for req in (a, b):
            self.assertIsNotNone(req.prepare_s)
            self.assertIsNotNone(req.join_s)
        gen.close()

    def test_decode_stall_sizes_chunks_from_step_times(self):
        # decode_stall: while a request decodes, each prefill chunk is sized from the step
        # times (between MIN_STALL_CHUNK and prefill_chunk_tokens), one chunk per step, and
        # the tokens are those of each request decoded alone.
        with self.assertRaises(ValueError):
            serving.Generator(self.client, tiny_llama(self.seed), self.profile(), decode_stall=1.5)
        with self.assertRaises(ValueError):
            serving.Generator(self.client, tiny_llama(self.seed), self.profile(), prefill_chunk_tokens=512,
                              decode_stall=1.0)
        model = tiny_llama(self.seed)
        short, long_ = self.prompt(96), self.prompt(700)
        refs = [self.reference(model, short, 16, "stall-short"), self.reference(model, long_, 3, "stall-long")]
        gen = serving.Generator(self.client, model, self.profile(), max_batch=2, prefill_chunk_tokens=512,
                                decode_stall=1.5, model_id="serving-stall-%d" % self.seed)
        # The controller's arithmetic: a plain step of 10 ms; a step with a 256-token chunk
        # that took 30 ms spent 20 ms prefilling against a 5 ms share: the next chunk halves
        # (at most per step), and never below MIN_STALL_CHUNK; a cheap one doubles.
        gen._note_step(0.010, None)
        gen._stall_chunk = 256
        gen._note_step(0.030, 256)
        self.assertEqual(gen._stall_chunk, 128)
        gen._note_step(0.030, 128)
        self.assertEqual(gen._stall_chunk, serving.MIN_STALL_CHUNK)
        gen._note_step(0.011, 128)
        self.assertEqual(gen._stall_chunk, 256)
        gen._decode_s = gen._stall_chunk = None
        sizes = []
        advance = gen._prefill_advance
        b = None  # the long request, once submitted

        def recording(state, chunk=None):
            if state[0] is b:
                sizes.append((min(state[2].shape[1], state[3] + chunk) - state[3], bool(gen.running)))
            return advance(state, chunk)
        gen._prefill_advance = recording
        a = gen.submit(short, 16)
        while not gen.running:
            gen.step()
        b = gen.submit(long_, 3)
        while gen.busy:
            forwards = len(sizes)
            gen.step()
            self.assertLessEqual(len(sizes) - forwards, 1)  # one prefill forward per step
        self.assertEqual(sum(n for n, _ in sizes), 700)
        # The Generator's own record of its prefill forwards: a's, then b's.
        self.assertEqual(sum(n for n, _ in gen.prefill_forwards), 96 + 700)
        for n, decoding in sizes[:-1]:  # the last is what remained of the prompt
            self.assertLessEqual(n, 512)
            if decoding:
                self.assertGreaterEqual(n, serving.MIN_STALL_CHUNK)
        self.assertEqual(a.tokens, refs[0])
        self.assertEqual(b.tokens, refs[1])
        gen.close()

    def test_a_kept_prefix_is_not_prefilled_again(self):
        # Two questions over one document (a segment end at the document's end): the first
        # request keeps the document's exact K/V, the second starts its prefill after the
        # document (the daemon reusing its segment) and decodes the tokens of its prompt
        # decoded alone. Kept on the GPU (where the prefill's history held them) while they
        # fit prefix_cache_device_bytes, else in host memory; without a prefix cache both
        # are prefilled whole.
        model = tiny_llama(self.seed)
        doc = self.prompt(256)
        p1, p2 = doc + self.prompt(40), doc + self.prompt(72)
        refs = [self.reference(model, p, 5, "kept%d" % i, segment_ends=(256,)) for i, p in enumerate((p1, p2))]
        gpu = next(model.parameters()).is_cuda
        GIB = 1 << 30
        # (host bytes, device bytes, history on the device, where the prefix is kept)
        for host, dev, hist, kept in ((GIB, 0, GIB, "host"), (GIB, GIB, GIB, "device" if gpu else "host"),
                                      (GIB, GIB, 0, "host"), (0, 0, GIB, None)):
            name = "%d-%d-%d" % (host, dev, hist)
            gen = serving.Generator(self.client, model, self.profile(), prefill_chunk_tokens=96,
                                    prefix_cache_bytes=host, prefix_cache_device_bytes=dev, history_device_bytes=hist,
                                    model_id="serving-kept-%s-%d" % (name, self.seed))
            a = gen.submit(p1, 5, segment_ends=(256,))
            gen.run()
            self.assertEqual(a.prefill_skipped, 0)
            self.assertEqual((gen.prefix_bytes > 0, gen.prefix_device_bytes > 0),
                             (kept == "host", kept == "device"), name)
            b = gen.submit(p2, 5, segment_ends=(256,))
            gen.run()
            self.assertGreaterEqual(b.reused_tokens, 256)
            self.assertEqual(b.prefill_skipped, 256 if kept else 0, name)
            self.assertEqual(a.tokens, refs[0], name)
            self.assertEqual(b.tokens, refs[1], name)
            gen.close()
        if not gpu:
            return
        # A second document's prefix takes the GPU's room: the first one moves to host memory
        # (still reused there), the newest stays on the GPU.
        doc2 = self.prompt(256)
        q1, q2 = doc2 + self.prompt(40), doc + self.prompt(56)
        refs = [self.reference(model, p, 4, "kept-lru%d" % i, segment_ends=(256,)) for i, p in enumerate((q1, q2))]
        one = 2 * LAYERS * H * 256 * D * 2  # one document's K and V, bf16
        gen = serving.Generator(self.client, model, self.profile(), prefill_chunk_tokens=96, prefix_cache_bytes=GIB,
                                prefix_cache_device_bytes=one, history_device_bytes=GIB,
                                model_id="serving-kept-lru-%d" % self.seed)
        gen.submit(p1, 2, segment_ends=(256,))
        gen.run()
        self.assertEqual((gen.prefix_device_bytes, gen.prefix_bytes), (one, 0))
        c = gen.submit(q1, 4, segment_ends=(256,))
        gen.run()
        self.assertEqual((gen.prefix_device_bytes, gen.prefix_bytes), (one, one))
        d = gen.submit(q2, 4, segment_ends=(256,))
        gen.run()
        self.assertEqual(d.prefill_skipped, 256)  # from host memory
        self.assertEqual(c.tokens, refs[0])
        self.assertEqual(d.tokens, refs[1])
        gen.close()

    def test_eos_ends_a_request_and_frees_its_sequence(self):
        model = tiny_llama(self.seed)
        prompt = self.prompt(128)
        ref = self.reference(model, prompt, 6, "eos")
        gen = serving.Generator(self.client, model, self.profile(), model_id="serving-eos-%d" % self.seed)
        req = gen.submit(prompt, 6, eos_token_id=ref[2])
        gen.run()
        self.assertEqual(req.finish_reason, "eos")
        self.assertEqual(req.tokens, ref[:ref.index(ref[2]) + 1])
        self.assertEqual(gen.cache.batch, 0)
        gen.close()

    def test_batch_cache_refusals(self):
        model = tiny_llama(self.seed)
        hf_cache.enable(model)
        cache = serving.BatchCache(self.client, model, model_id="serving-refusals-%d" % self.seed)
        with self.assertRaises(kvshade.errors.FailedPrecondition):
            cache.decode(model, torch.tensor([1]))
        with self.assertRaises(kvshade.errors.NotFound):
            cache.join("no-such-session")
        # A session of another model id is refused; one of this model joins.
        prompt = self.prompt(100)
        other = hf_cache.KvShadeCache(self.client, model, self.profile(), prompt_ids=prompt,
                                      model_id="serving-other-%d" % self.seed, decode=None)
        with torch.no_grad():
            model(input_ids=torch.tensor([prompt], device=DEV), past_key_values=other, use_cache=True)
        with self.assertRaises(kvshade.errors.FailedPrecondition):
            cache.join(other.session_ids[0])
        with self.assertRaises(RuntimeError):  # a prefill-only cache does not decode
            with torch.no_grad():
                model(input_ids=torch.tensor([[5]], device=DEV), past_key_values=other, use_cache=True)
        exact = hf_cache.KvShadeCache(self.client, model, kvshade.Profile("exact"), prompt_ids=prompt,
                                      model_id="serving-refusals-%d" % self.seed, decode=None)
        with torch.no_grad():
            model(input_ids=torch.tensor([prompt], device=DEV), past_key_values=exact, use_cache=True)
        with self.assertRaises(kvshade.errors.FailedPrecondition):  # nothing compressed to decode here
            cache.join(exact.session_ids[0])
        self.assertEqual(cache.batch, 0)
        exact.close(close_session=True)
        mine = hf_cache.KvShadeCache(self.client, model, self.profile(), prompt_ids=prompt,
                                     model_id="serving-refusals-%d" % self.seed, decode=None)
        with torch.no_grad():
            model(input_ids=torch.tensor([prompt], device=DEV), past_key_values=mine, use_cache=True)
        # A prepared join (the daemon's calls, off the steps' thread) that is released leaves
        # the batch as it was; one that is joined takes the next index.
        prepared = cache.prepare_join(mine.session_ids[0])
        self.assertEqual(cache.batch, 0)
        cache.release(prepared)
        with self.assertRaises(kvshade.errors.KvShadeError):
            cache.release(prepared)  # the attachment is gone
        self.assertEqual(cache.join_prepared(cache.prepare_join(mine.session_ids[0])), 0)
        self.assertEqual(cache.batch, 1)
        with self.assertRaises(ValueError):
            cache.decode(model, torch.tensor([1, 2]))  # two tokens for one sequence
        with self.assertRaises(NotImplementedError):
            with torch.no_grad():
                model(input_ids=torch.tensor([[1, 2]], device=DEV), past_key_values=cache, use_cache=True,
                      position_ids=torch.tensor([[100, 101]], device=DEV))
        cache.close(close_sessions=True)
        other.close(close_session=True)


@unittest.skipUnless((HAVE_TRANSFORMERS or REQUIRE_GPU) and BACKEND == "cuda",
                     WHY or "the device ingest path needs a daemon on the cuda backend (KVSHADE_TEST_BACKEND=cuda)")
class DeviceIngestWindowTest(_WithServer):
    def test_layers_sent_from_the_gpu_are_freed_after_the_commit(self):
        # The daemon opens each layer by CUDA IPC; once the stream is committed and the
        # tensors dropped, their memory is this process's again (no block stays held for a
        # consumer that never releases it).
        n, h, hq, d, L = 4096, 2, 4, 64, 4
        spec = kvshade.ModelSpec("leak-%d" % self.seed, L, hq, h, d)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        for rep in range(3):
            created = self.client.create_session(spec, kvshade.Profile("shadow", rank=32), list(range(rep, rep + n)))
            with self.client.ingest(created.session_id, "bf16") as ing:
                for layer in range(L):
                    k = torch.randn(n, h, d, device="cuda").to(torch.bfloat16)
                    v = torch.randn(n, h, d, device="cuda").to(torch.bfloat16)
                    ing.layer_cuda(layer, k, v)
                    del k, v
                ing.commit()
            self.client.close_session(created.session_id)
        torch.cuda.synchronize()
        self.assertEqual(torch.cuda.memory_allocated(), base)

    def test_layers_leave_the_gpu_as_the_daemon_takes_them(self):
        torch.manual_seed(self.seed)
        model = tiny_llama(self.seed)
        n = 640
        prompt = torch.randint(3, 97, (n,)).tolist()
        layer_bytes = 2 * n * model.config.num_key_value_heads * model.config.head_dim * 2
        held = []
        release = kvshade.client.Ingest.release_taken

        def spy(ing, max_held_bytes=None, timeout=600.0):
            r = release(ing, max_held_bytes, timeout)
            held.append((len(ing._keep), r, ing.held_cuda_bytes))
            return r
        kvshade.client.Ingest.release_taken = spy
        try:
            hf_cache.enable(model)
            kc = hf_cache.KvShadeCache(self.client, model, kvshade.Profile("exact"), prompt_ids=prompt,
                                       model_id="window-%d" % self.seed, ingest="device",
                                       ingest_window_bytes=layer_bytes)
            ids = torch.tensor([prompt], device=DEV)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=kc, max_new_tokens=5,
                                     min_new_tokens=5, do_sample=False, pad_token_id=0)
        finally:
            kvshade.client.Ingest.release_taken = release
        self.assertIsNone(kc.ingest_error)
        self.assertEqual(len(held), model.config.num_hidden_layers)
        for sent, released, bytes_held in held:
            # After each layer: at most the window (one layer) beyond the newest is held.
            self.assertLessEqual(sent - released, 1)
            self.assertLessEqual(bytes_held, layer_bytes)
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=Bf16DynamicCache(),
                                 max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
        self.assertEqual(out[0, n:].tolist(), ref[0, n:].tolist())
        kc.close(close_session=True)


def two_devices():
    """A daemon backend of two devices where this worker's model can decode from either: two
    CPU devices for a model on the CPU, the first two GPUs for one on a GPU (None: one GPU)."""
    if DEV.type == "cpu":
        return "cpu:0,cpu:1"
    return "cuda:0,cuda:1" if torch.cuda.device_count() >= 2 else None


@unittest.skipUnless(HAVE_TRANSFORMERS or REQUIRE_GPU, WHY)
class DevicesServingTest(_WithServer):
    """serving.Generator and BatchCache on a daemon with two devices (docs/OPERATIONS.md
    "Devices"): the requests' sessions go to the model's device (on a GPU: the daemon's device
    with its PCI bus id; on the CPU: where device= says), and the batch refuses a session on
    the other device."""

    @classmethod
    def setUpClass(cls):
        if HAVE_TRANSFORMERS:  # else _WithServer says why
            cls.server_backend = two_devices()
            if cls.server_backend is None:
                raise unittest.SkipTest("one GPU: a daemon of two GPUs needs two")
        super().setUpClass()

    def test_sessions_go_to_the_models_device_and_the_batch_refuses_others(self):
        model = tiny_llama(self.seed)
        profile = ServingTest.profile()
        names = [d["device"] for d in self.client.device_stats()]
        if DEV.type == "cpu":
            place, want = "cpu:1", "cpu:1"  # a CPU model has no device of its own: name one
        else:  # default: the daemon's device that is the model's GPU
            from kvshade.routing import local_gpu_pci_bus_id
            bus = kvshade.routing._pci_address(local_gpu_pci_bus_id(torch.cuda.current_device()))
            place = None
            want = [d["device"] for d in self.client.device_stats()
                    if d["pci_bus_id"] and kvshade.routing._pci_address(d["pci_bus_id"]) == bus][0]
        other = [n for n in names if n != want][0]
        gen = serving.Generator(self.client, model, profile, model_id="serving-devices-%d" % self.seed,
                                device=place)
        self.assertEqual(gen.cache.session_device, want)
        prompt = torch.randint(3, 97, (120,), generator=self.gen).tolist()
        req = gen.submit(prompt, 4)
        gen.step()  # prefilled and joined: its session is open on the batch's device
        self.assertEqual(self.client.get_session(req.session_id)["device"], want)
        on = {d["device"]: d for d in self.client.device_stats()}
        self.assertEqual(on[want]["sessions"], 1)
        self.assertEqual(on[other]["sessions"], 0)
        gen.run()
        self.assertEqual(req.finish_reason, "length")
        self.assertEqual(len(req.tokens), 4)
        # A session on the other device: the batch's attach names its device and is refused.
        kc = hf_cache.KvShadeCache(self.client, model, profile, prompt_ids=prompt, decode=None, ingest="host",
                                   model_id="serving-devices-%d" % self.seed, device=other)
        kc.prefill(model)
        sid, _ = serving.ready_session(kc)
        self.assertEqual(self.client.get_session(sid)["device"], other)
        with self.assertRaises(kvshade.errors.FailedPrecondition) as e:
            gen.cache.join(sid)
        self.assertIn("the worker is on device %s" % want, str(e.exception))
        self.assertEqual(gen.cache.batch, 0)
        self.client.close_session(sid)
        with self.assertRaises(ValueError):  # one device for the batch and its prompts
            serving.Generator(self.client, model, profile, cache_kwargs={"device": other})
        gen.close()


if __name__ == "__main__":
    unittest.main()
