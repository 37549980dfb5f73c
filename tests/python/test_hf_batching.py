"""kvshade.integrations.hf_batching: transformers' continuous batching (generate_batch and the
ContinuousBatchingManager) with kvshade holding every request's context, on the tiny random
Llama of test_hf_adapter and a real kvshade-server.

  * generate_batch: each request's greedy tokens equal those of kvshade's own continuous
    batching (serving.Generator: the same KvShadeCache prefill, the same shadow profile and
    LocalDecoder, hence the same selection) for the same prompts, with transformers
    splitting the long prompts into chunks (max_batch_tokens below the prompt lengths).
  * The manager: requests of different prompt lengths and max_new_tokens (one of them a
    single token, which finishes before it ever decodes) join and leave one decode batch;
    sequences of different lengths decode together; every request's session is closed once
    it finishes and nothing stays attached.
  * Refusals: forked requests, a paged cache kvshade did not attach to.

Skipped without transformers (Debian has none); KVSHADE_REQUIRE_GPU=1 makes that a failure.

    cd tests/python && KVSHADE_SERVER=... KVSHADE_LIB=... KVSHADE_TEST_BACKEND=cuda \\
        KVSHADE_TEST_HEAD_DIM=64 python3 run_unittest.py test_hf_batching
"""
import inspect
import time
import unittest

import kvshade_testutil  # noqa: F401 - puts the package and its library on the path first

import kvshade
import test_hf_adapter
from test_hf_adapter import REQUIRE_GPU
from test_serving import _WithServer  # a server, a client, a seed and a generator per class

HAVE_TRANSFORMERS, WHY = test_hf_adapter.HAVE_TRANSFORMERS, test_hf_adapter.WHY
if HAVE_TRANSFORMERS:  # test_hf_adapter defines these only where transformers imports
    import torch

    try:
        from transformers import GenerationConfig

        from kvshade.integrations import hf_batching, hf_cache, serving
    except ImportError as e:  # a transformers without continuous batching
        HAVE_TRANSFORMERS, WHY = False, "kvshade.integrations.hf_batching does not import: %s" % e
    from test_hf_adapter import tiny_llama


def _finished(result):
    done = getattr(result, "is_finished", None)
    if callable(done):
        return done()
    return str(getattr(result, "status", "")).endswith("FINISHED")


@unittest.skipUnless(HAVE_TRANSFORMERS or REQUIRE_GPU, WHY)
class HfBatchingTest(_WithServer):
    @classmethod
    def setUpClass(cls):
        if not HAVE_TRANSFORMERS:  # also when transformers imports but hf_batching does not
            raise AssertionError("KVSHADE_REQUIRE_GPU=1: " + WHY)
        super().setUpClass()
    def prompt(self, n):
        return torch.randint(3, 97, (n,), generator=self.gen).tolist()

    @staticmethod
    def profile():
        return kvshade.Profile("shadow", rank=16, chunk_size=8, sparse_budget=6, outliers=2, local_window=32)

    def generator_tokens(self, model, prompts, steps, name):
        """Each prompt's greedy tokens through kvshade.integrations.serving.Generator (its own model id)."""
        gen = serving.Generator(self.client, model, self.profile(), max_batch=len(prompts),
                                model_id="cb-ref-%s-%d" % (name, self.seed))
        reqs = [gen.submit(p, s) for p, s in zip(prompts, steps)]
        gen.run()
        gen.close()
        for r in reqs:
            self.assertEqual(r.finish_reason, "length", r.error)
        return [r.tokens for r in reqs]

    def enable(self, model, name, steps, max_batch_tokens, **kwargs):
        cb = hf_batching.configure(max_batch_tokens=max_batch_tokens)
        # The paged cache is only bookkeeping here: a fixed, small number of blocks (sizing
        # from a share of free memory can round past that share and refuse to start).
        if hasattr(cb, "num_blocks"):
            cb.num_blocks = 64
        elif hasattr(cb, "max_memory_percent"):
            cb.max_memory_percent = 0.05
        gc = GenerationConfig(do_sample=False, max_new_tokens=steps)
        manager = hf_batching.enable(model, self.client, self.profile(), generation_config=gc,
                                     continuous_batching_config=cb, model_id="cb-%s-%d" % (name, self.seed),
                                     **kwargs)
        self.addCleanup(hf_batching.disable, model)
        return manager

    def check_released(self, batching):
        self.assertEqual(batching.active, 0)
        self.assertEqual(batching.batch.batch, 0)
        self.assertTrue(batching.sessions_served)
        for sid in batching.sessions_served:
            with self.assertRaises(kvshade.errors.NotFound):
                self.client.get_session(sid)

    def test_generate_batch_equals_kvshade_serving(self):
        model = tiny_llama(self.seed)
        prompts = [self.prompt(n) for n in (96, 200, 330)]
        refs = self.generator_tokens(model, prompts, [8] * 3, "gb")
        manager = self.enable(model, "gb", 8, max_batch_tokens=128)
        self.assertIs(model.init_continuous_batching(), manager)
        kwargs = {"max_new_tokens": 8}
        if "progress_bar" in inspect.signature(model.generate_batch).parameters:
            kwargs["progress_bar"] = False
        out = model.generate_batch(prompts, **kwargs)
        batching = manager.kvshade
        errors = "\n".join(batching.errors)
        self.assertEqual(len(out), len(prompts), errors)
        for i, ref in enumerate(refs):
            res = out["req_%d" % i]
            self.assertIsNone(getattr(res, "error", None), errors)
            self.assertEqual(list(res.generated_tokens), ref, "request %d (%d prompt tokens)\n%s"
                             % (i, len(prompts[i]), errors))
        # transformers split the prompts (128 tokens per forward) and decoded them together.
        self.assertGreater(batching.stats["prefill_chunks"], len(prompts))
        self.assertGreaterEqual(batching.stats["max_batch"], 2)
        self.assertEqual(batching.stats["requests"], len(prompts))
        self.assertFalse(batching.errors, errors)
        self.check_released(batching)
        # A second call reuses the manager with a fresh paged cache.
        # (The manager's request ids go on counting: the one result is under its next id.)
        again = model.generate_batch(prompts[:1], **kwargs)
        self.assertEqual(len(again), 1, "\n".join(batching.errors))
        self.assertEqual(list(next(iter(again.values())).generated_tokens), refs[0],
                         "\n".join(batching.errors))

    def test_requests_join_and_leave_the_decode_batch(self):
        model = tiny_llama(self.seed)
        lengths, steps = [150, 230, 96, 310], [12, 3, 6, 1]
        prompts = [self.prompt(n) for n in lengths]
        refs = self.generator_tokens(model, prompts, steps, "jl")
        manager = self.enable(model, "jl", 16, max_batch_tokens=256)
        manager.start()
        try:
            ids = [manager.add_request(p, max_new_tokens=s) for p, s in zip(prompts, steps)]
            results, deadline = {}, time.monotonic() + 120
            while len(results) < len(ids) and time.monotonic() < deadline:
                r = manager.get_result(timeout=1)
                if r is not None and _finished(r):
                    results[r.request_id] = r
                elif r is None and not manager.is_running():
                    break
        finally:
            manager.stop(block=True)
        batching = manager.kvshade
        errors = "\n".join(batching.errors)
        self.assertEqual(sorted(results), sorted(ids), errors)
        for rid, ref, n in zip(ids, refs, lengths):
            self.assertEqual(list(results[rid].generated_tokens), ref, "request %s (%d prompt tokens)\n%s"
                             % (rid, n, errors))
        # Sequences of different lengths decoded in one batch, which changed as they came and went.
        self.assertGreaterEqual(batching.stats["max_batch"], 2)
        self.assertGreater(batching.stats["max_spread"], 0)
        self.assertEqual(batching.stats["finished"], len(ids))
        self.assertFalse(batching.errors, errors)
        self.check_released(batching)

    def test_device_reaches_every_requests_session(self):
        # This daemon has one device: by default the decode batch and the requests' caches give
        # it none (as before); device= (here its own name) reaches every request's session
        # and the batch's attach; the requests' caches cannot be given another.
        model = tiny_llama(self.seed)
        hf_cache.enable(model)
        plain = hf_batching.KvShadeBatching(self.client, model, self.profile())
        self.assertEqual((plain.batch.session_device, plain.cache_kwargs["device"]), ("", ""))
        plain.close()
        name = self.client.device_stats()[0]["device"]  # "cpu" or "cuda"
        with self.assertRaises(ValueError):
            hf_batching.KvShadeBatching(self.client, model, self.profile(), cache_kwargs={"device": name})
        asked, create, attach = [], kvshade.Client.create_session, kvshade.Client.attach

        def spy_create(client, *a, **kw):
            asked.append(("create", kw.get("device")))
            return create(client, *a, **kw)

        def spy_attach(client, *a, **kw):
            asked.append(("attach", kw.get("device")))
            return attach(client, *a, **kw)
        kvshade.Client.create_session, kvshade.Client.attach = spy_create, spy_attach
        try:
            manager = self.enable(model, "device", 3, max_batch_tokens=128, device=name)
            kwargs = {"max_new_tokens": 3}
            if "progress_bar" in inspect.signature(model.generate_batch).parameters:
                kwargs["progress_bar"] = False
            out = model.generate_batch([self.prompt(96), self.prompt(140)], **kwargs)
        finally:
            kvshade.Client.create_session, kvshade.Client.attach = create, attach
        batching = manager.kvshade
        self.assertEqual(len(out), 2, "\n".join(batching.errors))
        self.assertEqual(batching.batch.session_device, name)
        self.assertEqual(sorted(set(asked)), [("attach", name), ("create", name)])
        self.assertEqual(sum(1 for what, _ in asked if what == "create"), 2)
        self.check_released(batching)

    def test_refusals(self):
        model = tiny_llama(self.seed)
        with self.assertRaises(ValueError):
            hf_batching.enable(model, self.client, self.profile(),
                               generation_config=GenerationConfig(do_sample=False, num_return_sequences=2,
                                                                  num_beams=2))
        self.assertIsNone(hf_batching.manager_of(model))
        # A continuous-batching forward whose paged cache kvshade did not attach to.
        module = next(m for m in model.modules() if hasattr(m, "layer_idx"))
        q = torch.zeros(1, 4, 3, 64)
        with self.assertRaises(RuntimeError):
            hf_batching.paged_kvshade_attention(module, q, q[:, :2], q[:, :2], None, cache=object())


if __name__ == "__main__":
    unittest.main()
