"""kvshade.decoders.local.LocalDecoder (same-node decode) through the C ABI and the Python package,
against the daemon's Attend RPC on the same inputs. The daemon's backend comes from
KVSHADE_TEST_BACKEND (cpu here; cuda on a GPU machine, where the decoder maps the daemon's
device memory by CUDA IPC and runs on CUDA tensors).

Tolerance: the same kernels over the same bf16 inputs; only the order in which attention
blocks are merged differs (fp32 online softmax): 1e-5 of the output's largest magnitude on
the CPU, 1e-4 on CUDA (its split-K merge order differs too)."""
import os
import re
import subprocess
import sys
import threading
import time
import unittest

import numpy as np
import torch

from kvshade_testutil import Server

import kvshade
from kvshade import _native
from kvshade.decoders.base import Decoder
from kvshade.decoders.local import LocalDecoder

L, HQ, H, D, N = 2, 4, 2, 64, 512
BACKEND = os.environ.get("KVSHADE_TEST_BACKEND", "cpu")
DEVICE = "cuda" if BACKEND.startswith("cuda") else "cpu"
TOL = 1e-4 if DEVICE == "cuda" else 1e-5


class LocalDecoderTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server()
        cls.client = kvshade.Client(cls.server.target)
        cls.client.wait_ready(30)
        rng = np.random.default_rng(5)
        cls.model = kvshade.ModelSpec("test/local", L, HQ, H, D)
        cls.profile = kvshade.Profile("shadow", rank=16, sparse_budget=8, outliers=4, chunk_size=8)
        cls.sessions = []
        for s in range(2):
            ids = rng.integers(0, 1000, N).tolist()
            created = cls.client.create_session(cls.model, cls.profile, ids)
            with cls.client.ingest(created.session_id, "bf16") as ing:
                for layer in range(L):
                    lat = rng.standard_normal((N, 8)).astype(np.float32)
                    k = (lat @ rng.standard_normal((8, H * D)).astype(np.float32)).reshape(N, H, D)
                    v = rng.standard_normal((N, H, D)).astype(np.float32)
                    ing.layer(layer, k, v)
                ing.commit()
            cls.sessions.append(created.session_id)

    @classmethod
    def tearDownClass(cls):
        for s in cls.sessions:
            cls.client.close_session(s)
        cls.client.close()
        cls.server.stop()

    def attach(self, i):
        a = self.client.attach(self.sessions[i], "test-local").attachment_id
        self.addCleanup(self.client.detach, a)
        return a

    def rel(self, ref, out):
        return float(np.abs(ref - out).max() / max(np.abs(ref).max(), 1e-30))

    def test_closing_the_client_closes_its_decoders_first(self):
        # A decoder renews its leases through its client on a thread of its own: a client
        # closed while the decoder is still open closes the decoder first (its renewals
        # would call a freed client), and the decoder then refuses calls.
        client = kvshade.Client(self.server.target)
        a = client.attach(self.sessions[0], "test-local-close", lease_ms=2000).attachment_id
        dec = LocalDecoder(client, [a], backend=BACKEND)
        self.assertEqual(dec.batch, 1)
        client.close()
        self.assertFalse(dec._h)
        time.sleep(1.0)  # past a renewal period (lease / 3): nothing calls the freed client
        with self.assertRaises(kvshade.errors.KvShadeError):
            dec.join(a)
        dec.close()  # again: nothing to do

    def test_matches_attend_rpc_batch_of_two(self):
        atts = [self.attach(0), self.attach(1)]
        with LocalDecoder(self.client, atts, backend=BACKEND) as dec:
            self.assertEqual((dec.batch, dec.layers, dec.kv_heads, dec.query_heads, dec.head_dim), (2, L, H, HQ, D))
            g = torch.Generator().manual_seed(3)
            for layer in range(L):
                for step in range(3):  # later steps hit the slot tables
                    q = torch.randn(2, HQ, D, generator=g).to(torch.bfloat16)
                    out = dec.attend(layer, q.to(DEVICE)).cpu().numpy()
                    ref = self.client.attend(layer, atts, q.float().numpy())
                    self.assertLess(self.rel(ref, out), TOL, f"layer {layer} step {step}")
            self.assertEqual(dec.stats()["steps"], 0)

    def test_lse_merges_with_other_tokens(self):
        # The decoder's (out, lse) over the session merged with one more token by hand
        # equals the decoder's answer with that token as the new one.
        (a,) = [self.attach(1)]
        with LocalDecoder(self.client, [a], backend=BACKEND) as dec:
            q = torch.randn(1, HQ, D).to(torch.bfloat16)
            k = torch.randn(1, H, D).to(torch.bfloat16)
            v = torch.randn(1, H, D).to(torch.bfloat16)
            o1, l1 = dec.attend(0, q.to(DEVICE), return_lse=True)
            o2, l2 = dec.attend(0, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), return_lse=True)
            o1, l1, o2, l2 = (t.cpu().double() for t in (o1, l1, o2, l2))
            g = HQ // H
            s = (q.double().reshape(H, g, D) * k.double().reshape(H, 1, D)).sum(-1).reshape(1, HQ) / D ** 0.5
            vv = v.double().repeat_interleave(g, dim=1)
            merged = (torch.exp(l1)[..., None] * o1 + torch.exp(s)[..., None] * vv) / (torch.exp(l1) + torch.exp(s))[..., None]
            self.assertLess(float((merged - o2).abs().max() / o2.abs().max()), TOL)
            self.assertLess(float((torch.logaddexp(l1, s) - l2).abs().max()), 1e-4)

    def test_new_token_is_attended(self):
        # With a new token whose key matches the query, the output moves toward its value:
        # out = (1 - w) * out_session + w * v_new per query head, w in (0, 1).
        (a,) = [self.attach(0)]
        with LocalDecoder(self.client, [a], backend=BACKEND) as dec:
            q = torch.randn(1, HQ, D).to(torch.bfloat16)
            base = dec.attend(0, q.to(DEVICE)).cpu().numpy()[0]
            k_new = (q.float().reshape(H, HQ // H, D).sum(1) * 0.3).to(torch.bfloat16)[None]
            v_new = torch.full((1, H, D), 3.0).to(torch.bfloat16)
            out = dec.attend(0, q.to(DEVICE), k_new.to(DEVICE), v_new.to(DEVICE)).cpu().numpy()[0]
            for qh in range(HQ):
                # The output lies on the segment from base to v_new: solve for w.
                diff = 3.0 - base[qh]
                w = float(np.dot(out[qh] - base[qh], diff) / np.dot(diff, diff))
                self.assertGreater(w, 0.0)
                self.assertLess(w, 1.0)
                np.testing.assert_allclose(out[qh], base[qh] + w * diff, atol=2e-4 * max(1, np.abs(out[qh]).max()))
            dec.advance()
            self.assertEqual(dec.stats()["steps"], 1)

    def test_steps_replay_from_a_cuda_graph(self):
        # A runtime that captures its decode step in a CUDA graph: capture one step of every
        # layer once, replay it for later steps (the step counters live on the device), and
        # get what an eager decoder over the same session and tokens gets, bit for bit.
        if DEVICE != "cuda":
            self.skipTest("CUDA graphs need a CUDA daemon and device (KVSHADE_TEST_BACKEND=cuda)")
        eager = LocalDecoder(self.client, [self.attach(0)], backend=BACKEND)
        graphed = LocalDecoder(self.client, [self.attach(0)], backend=BACKEND)
        g = torch.Generator().manual_seed(11)
        q = torch.zeros(L, 1, HQ, D, dtype=torch.bfloat16, device="cuda")
        kn = torch.zeros(1, H, D, dtype=torch.bfloat16, device="cuda")
        vn = torch.zeros(1, H, D, dtype=torch.bfloat16, device="cuda")
        outs = torch.zeros(L, 1, HQ, D, dtype=torch.float32, device="cuda")
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on the capture stream, as torch asks
            for layer in range(L):
                graphed.attend(layer, q[layer], kn, vn, outs[layer])
        torch.cuda.current_stream().wait_stream(side)
        for layer in range(L):  # the same first step for the eager decoder's slot tables
            eager.attend(layer, q[layer], kn, vn)
        with torch.cuda.graph(graph):
            for layer in range(L):
                graphed.attend(layer, q[layer], kn, vn, outs[layer])
        for step in range(4):
            qs = torch.randn(L, 1, HQ, D, generator=g).to(torch.bfloat16)
            ks = torch.randn(1, H, D, generator=g).to(torch.bfloat16)
            vs = torch.randn(1, H, D, generator=g).to(torch.bfloat16)
            q.copy_(qs)
            kn.copy_(ks)
            vn.copy_(vs)
            graph.replay()
            for layer in range(L):
                ref = eager.attend(layer, qs[layer].cuda(), ks.cuda(), vs.cuda())
                torch.cuda.synchronize()
                self.assertTrue(torch.equal(ref, outs[layer]), f"step {step} layer {layer}")
            graphed.advance()
            eager.advance()
        eager.close()
        graphed.close()

    @staticmethod
    def _random_layers(rng):
        """Per layer a random K and V [N, H, D] bf16 (host memory)."""
        def one():
            return torch.from_numpy(rng.standard_normal((N, H, D)).astype(np.float32)).to(torch.bfloat16)
        return [one() for _ in range(L)], [one() for _ in range(L)]

    def _assert_same_sessions(self, a, b):
        """Attachments a and b hold the same static sets and attend alike, bit for bit."""
        for layer in range(L):
            sa, sb = self.client.static_set(a, layer), self.client.static_set(b, layer)
            np.testing.assert_array_equal(sa.k, sb.k)
            np.testing.assert_array_equal(sa.tail_v, sb.tail_v)
            q = torch.randn(1, HQ, D).to(torch.bfloat16).float().numpy()
            np.testing.assert_array_equal(self.client.attend(layer, [a], q), self.client.attend(layer, [b], q))

    def test_ingest_from_gpu_memory_equals_inline(self):
        # Same-node ingest: the daemon reads each layer from this process's GPU memory (CUDA
        # IPC) instead of bytes on the wire; the session it builds is the same, bit for bit.
        if DEVICE != "cuda":
            self.skipTest("needs a CUDA daemon and device (KVSHADE_TEST_BACKEND=cuda)")
        rng = np.random.default_rng(9)
        ids = rng.integers(0, 1000, N).tolist()
        ks, vs = self._random_layers(rng)
        atts = []
        for mode in ("inline", "cuda"):
            model = kvshade.ModelSpec("test/ingest-" + mode, L, HQ, H, D)  # separate prefix caches
            created = self.client.create_session(model, self.profile, ids)
            self.addCleanup(self.client.close_session, created.session_id)
            with self.client.ingest(created.session_id, "bf16") as ing:
                for layer in range(L):
                    if mode == "inline":
                        ing.layer(layer, ks[layer], vs[layer])
                    else:
                        # a slice of a bigger allocation: the offset inside it is carried
                        big = torch.zeros(2 * N, H, D, dtype=torch.bfloat16, device="cuda")
                        big[N:] = ks[layer].cuda()
                        ing.layer_cuda(layer, big[N:], vs[layer].cuda().contiguous())
                ing.commit()
            atts.append(self.client.attach(created.session_id, "ingest-test").attachment_id)
            self.addCleanup(self.client.detach, atts[-1])
        self._assert_same_sessions(*atts)

    def test_ingest_from_gpu_memory_refuses_non_finite_values(self):
        # A NaN in a layer read from this process's GPU memory fails the stream like one in
        # inline bytes: INVALID_ARGUMENT naming the layer, tensor and flat index; nothing
        # is committed.
        if DEVICE != "cuda":
            self.skipTest("needs a CUDA daemon and device (KVSHADE_TEST_BACKEND=cuda)")
        rng = np.random.default_rng(10)
        ids = rng.integers(0, 1000, N).tolist()
        k = torch.from_numpy(rng.standard_normal((N, H, D)).astype(np.float32)).to(torch.bfloat16).cuda()
        v = k.clone()
        t, h, d = N // 2, H - 1, 3
        v[t, h, d] = float("nan")
        created = self.client.create_session(kvshade.ModelSpec("test/ingest-nan", L, HQ, H, D), self.profile, ids)
        self.addCleanup(self.client.close_session, created.session_id)
        with self.assertRaises(kvshade.InvalidArgument) as cm:
            with self.client.ingest(created.session_id, "bf16") as ing:
                for layer in range(L):
                    ing.layer_cuda(layer, k, v if layer == L - 1 else k)
                ing.commit()
        self.assertIn("layer %d v holds a non-finite value at flat index %d" % (L - 1, (t * H + h) * D + d),
                      str(cm.exception))
        self.assertEqual(self.client.get_session(created.session_id)["state"], "ingesting")

    def test_chunked_ingest_from_gpu_memory(self):
        # A chunked prefill's parts from this process's GPU memory: every layer's part of one
        # chunk, then the next chunk's, so that a layer waits in the daemon's host memory
        # between its parts. The session equals the inline one, bit for bit; a NaN in a part
        # that lands in such a host copy fails the stream naming the layer, tensor and index.
        if DEVICE != "cuda":
            self.skipTest("needs a CUDA daemon and device (KVSHADE_TEST_BACKEND=cuda)")
        rng = np.random.default_rng(11)
        ids = rng.integers(0, 1000, N).tolist()
        ks, vs = self._random_layers(rng)
        cuts = [0, N // 4, N // 2, N]
        atts = []
        for mode in ("inline", "chunks"):
            model = kvshade.ModelSpec("test/chunked-ingest-" + mode, L, HQ, H, D)  # separate prefix caches
            created = self.client.create_session(model, self.profile, ids)
            self.addCleanup(self.client.close_session, created.session_id)
            with self.client.ingest(created.session_id, "bf16") as ing:
                for layer in range(L):
                    if mode == "inline":
                        ing.layer(layer, ks[layer], vs[layer])
                for lo, hi in zip(cuts, cuts[1:]):
                    for layer in range(L if mode == "chunks" else 0):
                        ing.layer_cuda(layer, ks[layer][lo:hi].cuda().contiguous(),
                                       vs[layer][lo:hi].cuda().contiguous(), lo, hi == N)
                ing.commit()
            atts.append(self.client.attach(created.session_id, "chunked-ingest-test").attachment_id)
            self.addCleanup(self.client.detach, atts[-1])
        self._assert_same_sessions(*atts)
        # A NaN in layer 0's second part: layer 1's first part came after layer 0's first,
        # so layer 0 waits in host memory when it arrives.
        t, h, d = cuts[1] + 5, H - 1, 7
        bad_v = vs[0].clone()
        bad_v[t, h, d] = float("nan")
        created = self.client.create_session(kvshade.ModelSpec("test/chunked-ingest-nan", L, HQ, H, D),
                                             self.profile, ids)
        self.addCleanup(self.client.close_session, created.session_id)
        with self.assertRaises(kvshade.InvalidArgument) as cm:
            with self.client.ingest(created.session_id, "bf16") as ing:
                for lo, hi in zip(cuts, cuts[1:]):
                    for layer in range(L):
                        v = bad_v if layer == 0 else vs[layer]
                        ing.layer_cuda(layer, ks[layer][lo:hi].cuda().contiguous(),
                                       v[lo:hi].cuda().contiguous(), lo, hi == N)
                ing.commit()
        self.assertIn("layer 0 v", str(cm.exception))
        self.assertIn("non-finite value at flat index %d" % (((t - cuts[1]) * H + h) * D + d), str(cm.exception))
        self.assertEqual(self.client.get_session(created.session_id)["state"], "ingesting")

    def test_follows_the_decoder_protocol(self):
        # A step of every layer through the protocol's calls; without the recall guard the
        # decoder has no figures to report.
        (a,) = [self.attach(0)]
        with LocalDecoder(self.client, [a], backend=BACKEND) as dec:
            self.assertIsInstance(dec, Decoder)
            self.assertEqual((dec.batch, dec.layers, dec.kv_heads, dec.query_heads, dec.head_dim), (1, L, H, HQ, D))
            for layer in range(dec.layers):
                q = torch.randn(1, HQ, D).to(torch.bfloat16).to(DEVICE)
                k = torch.randn(1, H, D).to(torch.bfloat16).to(DEVICE)
                out = dec.attend(layer, q, k, k.clone())
                self.assertEqual((tuple(out.shape), out.dtype), ((1, HQ, D), torch.float32))
            dec.advance()
            st = dec.stats()
            self.assertEqual(st["steps"], 1)
            self.assertIn("selected", st)
            self.assertIn("hits", st)
            self.assertEqual(dec.selection(), [])

    def test_sequences_join_and_leave_between_steps(self):
        # An empty decoder filled by joins; every step each sequence attends as a decoder of
        # it alone fed the same tokens; a sequence that leaves closes the gap.
        a0, a1 = self.attach(0), self.attach(1)
        s0, s1 = self.attach(0), self.attach(1)
        g = torch.Generator().manual_seed(21)
        with LocalDecoder(self.client, [], backend=BACKEND) as dec, \
                LocalDecoder(self.client, [s0], backend=BACKEND) as solo0, \
                LocalDecoder(self.client, [s1], backend=BACKEND) as solo1:
            self.assertEqual(dec.batch, 0)
            self.assertEqual(dec.join(a0), 0)
            solos = [solo0]
            for step in range(5):
                if step == 2:
                    self.assertEqual(dec.join(a1), 1)
                    solos.append(solo1)
                if step == 4:
                    dec.leave(a0)
                    solos.pop(0)
                    self.assertEqual(dec.attachment_ids, [a1])
                self.assertEqual(dec.batch, len(solos))
                for layer in range(L):
                    q = torch.randn(dec.batch, HQ, D, generator=g).to(torch.bfloat16).to(DEVICE)
                    k = torch.randn(dec.batch, H, D, generator=g).to(torch.bfloat16).to(DEVICE)
                    v = torch.randn(dec.batch, H, D, generator=g).to(torch.bfloat16).to(DEVICE)
                    out = dec.attend(layer, q, k, v).cpu().numpy()
                    for b, solo in enumerate(solos):
                        ref = solo.attend(layer, q[b:b + 1].contiguous(), k[b:b + 1].contiguous(),
                                          v[b:b + 1].contiguous()).cpu().numpy()
                        self.assertLess(self.rel(ref[0], out[b]), TOL, f"step {step} layer {layer} seq {b}")
                dec.advance()
                for solo in solos:
                    solo.advance()
            with self.assertRaises(IndexError):
                dec.leave(3)

    def test_the_library_links_no_cuda_library(self):
        # libkvshade.so reaches the CUDA backend through the plugin libkvshade_cuda.so (loaded
        # at the first use), so a worker without CUDA loads it as it is.
        lib = _native.lib()
        path = _native._dlpath(lib) or getattr(lib, "_kvshade_path", None)
        if not path or not os.path.exists(path):
            self.skipTest("the library's file is not known here")
        out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
        needed = re.findall(r"\(NEEDED\).*\[(.*)\]", out)
        self.assertTrue(needed, out[:500])
        cuda = [n for n in needed if re.match(r"lib(cuda|cudart|cublas|cublasLt|cusolver|cusparse|nvJitLink)\b", n)]
        self.assertEqual(cuda, [], "libkvshade.so needs %s" % cuda)

    def test_a_missing_cuda_plugin_is_a_clear_error(self):
        # Without the plugin (here: a path where there is none) the CPU backend still serves
        # and a CUDA decoder is refused, saying what was not found.
        code = ("import kvshade, sys\n"
                "from kvshade.decoders.local import LocalDecoder\n"
                "c = kvshade.Client(sys.argv[1])\n"
                "try:\n"
                "    LocalDecoder(c, [], backend='cuda')\n"
                "except kvshade.Unavailable as e:\n"
                "    print('refused:', e)\n"
                "LocalDecoder(c, [], backend='cpu').close()\n"
                "c.close()\n")
        env = dict(os.environ, KVSHADE_CUDA_PLUGIN="/nonexistent/libkvshade_cuda.so",
                   PYTHONPATH=os.pathsep.join(sys.path))
        r = subprocess.run([sys.executable, "-c", code, self.server.target], capture_output=True, text=True,
                           env=env, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])
        self.assertIn("refused:", r.stdout)
        self.assertIn("libkvshade_cuda.so could not be loaded", r.stdout)
        self.assertIn("/nonexistent/libkvshade_cuda.so", r.stdout)

    def test_a_sequence_prepared_beside_the_steps_joins_as_a_plain_join(self):
        # prepare() on another thread while the batch steps, join() between steps: the new
        # sequence attends as a decoder of it alone; a prepared sequence is taken by its
        # join, and one that never joins is closed without harm.
        a0, a1, a2, s1 = self.attach(0), self.attach(1), self.attach(0), self.attach(1)
        g = torch.Generator().manual_seed(23)
        with LocalDecoder(self.client, [a0], backend=BACKEND) as dec, \
                LocalDecoder(self.client, [s1], backend=BACKEND) as solo:
            box = {}

            def prepare():
                try:
                    box["p"] = dec.prepare(a1)
                except BaseException as e:  # noqa: BLE001 - checked below
                    box["e"] = e
            t = threading.Thread(target=prepare)
            t.start()
            for _ in range(3):
                for layer in range(L):
                    q = torch.randn(1, HQ, D, generator=g).to(torch.bfloat16).to(DEVICE)
                    k = torch.randn(1, H, D, generator=g).to(torch.bfloat16).to(DEVICE)
                    dec.attend(layer, q, k, k.clone())
                dec.advance()
            t.join()
            self.assertNotIn("e", box)
            prepared = box["p"]
            self.assertEqual(prepared.attachment_id, a1)
            self.assertEqual(dec.join(prepared), 1)
            self.assertEqual(dec.attachment_ids, [a0, a1])
            with self.assertRaises(ValueError):
                dec.join(prepared)  # taken by the join
            for layer in range(L):
                q = torch.randn(2, HQ, D, generator=g).to(torch.bfloat16).to(DEVICE)
                k = torch.randn(2, H, D, generator=g).to(torch.bfloat16).to(DEVICE)
                out = dec.attend(layer, q, k, k.clone()).cpu().numpy()
                ref = solo.attend(layer, q[1:].contiguous(), k[1:].contiguous(), k[1:].clone()).cpu().numpy()
                self.assertLess(self.rel(ref[0], out[1]), TOL, f"layer {layer}")
            with self.assertRaises(kvshade.AlreadyExists):
                dec.prepare(a0)
            unused = dec.prepare(a2)
            unused.close()
            unused.close()
            self.assertEqual(dec.batch, 2)

    def test_extend_attends_the_tokens_as_steps_would(self):
        # Tokens added by extend() are attended as a decoder stepped through them attends
        # them; the other sequence is untouched; an overfull tail and bad shapes are refused.
        a0, a1, s0 = self.attach(0), self.attach(1), self.attach(0)
        g = torch.Generator().manual_seed(33)
        n = 3
        with LocalDecoder(self.client, [a0, a1], backend=BACKEND, local_capacity=8) as dec, \
                LocalDecoder(self.client, [s0], backend=BACKEND, local_capacity=8) as solo:
            ks = torch.randn(L, n, H, D, generator=g).to(torch.bfloat16).to(DEVICE)
            vs = torch.randn(L, n, H, D, generator=g).to(torch.bfloat16).to(DEVICE)
            for t in range(n):
                for layer in range(L):
                    q = torch.randn(1, HQ, D, generator=g).to(torch.bfloat16).to(DEVICE)
                    solo.attend(layer, q, ks[layer, t:t + 1].contiguous(), vs[layer, t:t + 1].contiguous())
                solo.advance()
            before = dec.attend(0, torch.zeros(2, HQ, D, dtype=torch.bfloat16, device=DEVICE)).cpu().numpy()
            with self.assertRaises(ValueError):
                dec.extend(0, ks[:1], vs[:1])  # one layer of L
            with self.assertRaises(kvshade.ResourceExhausted):
                dec.extend(0, torch.zeros(L, 9, H, D, dtype=torch.bfloat16, device=DEVICE),
                           torch.zeros(L, 9, H, D, dtype=torch.bfloat16, device=DEVICE))
            dec.extend(0, ks, vs)
            for layer in range(L):
                q = torch.randn(2, HQ, D, generator=g).to(torch.bfloat16).to(DEVICE)
                out = dec.attend(layer, q).cpu().numpy()
                ref = solo.attend(layer, q[:1].contiguous()).cpu().numpy()
                self.assertLess(self.rel(ref[0], out[0]), TOL, f"layer {layer}")
                if layer == 0:
                    # The query of the step before differs; sequence 1 attends only its own.
                    self.assertGreater(self.rel(before[0], out[0]), 0.0)
            zero = dec.attend(0, torch.zeros(2, HQ, D, dtype=torch.bfloat16, device=DEVICE)).cpu().numpy()
            self.assertEqual(self.rel(before[1], zero[1]), 0.0)
            self.assertGreater(self.rel(before[0], zero[0]), 1e-3)  # sequence 0 attends n more tokens

    def test_recall_guard_and_native_ids_as_the_daemon(self):
        # A session whose profile turns the recall guard on (every step sampled, floor 1,
        # budget 2): the decoder's guard acts as the daemon's on the same queries (same
        # samples, recall and widened budgets), and attends as the daemon's Attend.
        rng = np.random.default_rng(8)
        profile = kvshade.Profile("shadow", rank=16, sparse_budget=2, outliers=4, chunk_size=8,
                                  recall_sample_rate=1.0, recall_floor=1.0, recall_action="widen")
        ids = rng.integers(0, 1000, N).tolist()
        created = self.client.create_session(kvshade.ModelSpec("test/local-guard", L, HQ, H, D), profile, ids)
        self.addCleanup(self.client.close_session, created.session_id)
        with self.client.ingest(created.session_id, "bf16") as ing:
            for layer in range(L):
                ing.layer(layer, rng.standard_normal((N, H, D)), rng.standard_normal((N, H, D)))
            ing.commit()
        a = self.client.attach(created.session_id, "test-local").attachment_id
        self.addCleanup(self.client.detach, a)
        g = torch.Generator().manual_seed(9)
        with LocalDecoder(self.client, [a], backend=BACKEND) as dec:
            for step in range(10):
                for layer in range(L):
                    q = torch.randn(1, HQ, D, generator=g).to(torch.bfloat16)
                    out = dec.attend(layer, q.to(DEVICE)).cpu().numpy()
                    ref = self.client.attend(layer, [a], q.float().numpy())
                    self.assertLess(self.rel(ref, out), TOL, f"step {step} layer {layer}")
            local = dec.selection(0)
            daemon = self.client.session_selection(created.session_id)
            key = lambda r: r["layer"]
            self.assertEqual([(r["layer"], r["samples"], r["budget"], r["fallback"]) for r in sorted(local, key=key)],
                             [(r["layer"], r["samples"], r["budget"], r["fallback"]) for r in sorted(daemon, key=key)])
            self.assertTrue(any(r["budget"] > 2 for r in local), local)
            # Model-native ids: the chunks the last step selected, given back, attend alike.
            q = torch.randn(1, HQ, D, generator=g).to(torch.bfloat16).to(DEVICE)
            first = dec.attend(0, q)
            chunks = torch.from_numpy(dec.selected(0, 0)).reshape(1, H, -1).contiguous().to(DEVICE)
            again = dec.attend(0, q, chunks=chunks)
            self.assertLess(self.rel(first.cpu().numpy(), again.cpu().numpy()), TOL)
            with self.assertRaises(ValueError):
                dec.attend(0, q, chunks=chunks.to(torch.int64))

    def test_selection_units_as_the_daemon(self):
        # A profile that selects units of 2 tokens (two stages, the same token budget: 8
        # chunks of 8 tokens are 32 units per head): the decoder attends as the daemon's
        # Attend, its slots count units, its selection holds unit ids, and model-native ids
        # (whole chunks) are refused. Its sessions' echo and attachments tell the unit.
        rng = np.random.default_rng(12)
        profile = kvshade.Profile("shadow", rank=16, sparse_budget=8, outliers=4, chunk_size=8,
                                  rerank_factor=4, selection_unit=2)
        ids = rng.integers(0, 1000, N).tolist()
        created = self.client.create_session(kvshade.ModelSpec("test/local-units", L, HQ, H, D), profile, ids)
        self.addCleanup(self.client.close_session, created.session_id)
        with self.client.ingest(created.session_id, "bf16") as ing:
            for layer in range(L):
                lat = rng.standard_normal((N, 8)).astype(np.float32)
                k = (lat @ rng.standard_normal((8, H * D)).astype(np.float32)).reshape(N, H, D)
                ing.layer(layer, k, rng.standard_normal((N, H, D)))
            ing.commit()
        self.assertEqual(self.client.get_session(created.session_id)["selection_unit"], 2)
        info = self.client.attach(created.session_id, "test-local")
        a = info.attachment_id
        self.addCleanup(self.client.detach, a)
        self.assertEqual((info.chunk_size, info.slots_per_head, info.slot_tokens), (8, 32, 2))
        g = torch.Generator().manual_seed(13)
        with LocalDecoder(self.client, [a], backend=BACKEND) as dec:
            for step in range(3):
                for layer in range(L):
                    q = torch.randn(1, HQ, D, generator=g).to(torch.bfloat16)
                    out = dec.attend(layer, q.to(DEVICE)).cpu().numpy()
                    ref = self.client.attend(layer, [a], q.float().numpy())
                    self.assertLess(self.rel(ref, out), TOL, f"step {step} layer {layer}")
                    sel = dec.selected(0, layer)
                    self.assertEqual(sel.shape, (H, 32))
                    self.assertTrue(((sel >= 0) & (sel < N // 2)).all(), sel)
            chunks = torch.zeros((1, H, 1), dtype=torch.int32, device=DEVICE) + 5
            with self.assertRaises(kvshade.InvalidArgument):
                dec.attend(0, torch.zeros(1, HQ, D, dtype=torch.bfloat16, device=DEVICE), chunks=chunks)
        # Units that do not divide the chunk size, or without two stages, are refused.
        for bad in (kvshade.Profile("shadow", rank=16, chunk_size=8, rerank_factor=4, selection_unit=3),
                    kvshade.Profile("shadow", rank=16, chunk_size=8, rerank_factor=1, selection_unit=2)):
            with self.assertRaises(kvshade.InvalidArgument):
                self.client.create_session(self.model, bad, ids)

    def test_bad_input_is_an_error(self):
        (a,) = [self.attach(1)]
        with LocalDecoder(self.client, [a], backend=BACKEND) as dec:
            with self.assertRaises(TypeError):
                dec.attend(0, torch.zeros(1, HQ, D, device=DEVICE))  # fp32, not bf16
            with self.assertRaises(ValueError):
                dec.attend(0, torch.zeros(2, HQ, D, dtype=torch.bfloat16, device=DEVICE))  # wrong batch
            with self.assertRaises(kvshade.InvalidArgument):
                dec.attend(L, torch.zeros(1, HQ, D, dtype=torch.bfloat16, device=DEVICE))  # no such layer
        with self.assertRaises(kvshade.NotFound):
            LocalDecoder(self.client, ["0" * 32], backend=BACKEND)


if __name__ == "__main__":
    unittest.main()
