"""kvshade.Client against a real kvshade-server: sessions, ingest, lookup, fork, attach,
static set, select, attend, append, stats, and exceptions mapped from status codes."""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

from kvshade_testutil import Server, seed

import kvshade

L, HQ, H, D = 2, 4, 2, 16


def model(dtype="bf16", name="py-test"):
    return kvshade.ModelSpec(name, num_layers=L, num_query_heads=HQ, num_kv_heads=H, head_dim=D, dtype=dtype)


def bf16(x):
    return kvshade.bf16_bits_to_f32(kvshade.f32_to_bf16_bits(x)).reshape(np.shape(x))


class ClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.rng = np.random.default_rng(seed())
        cls.server = Server()
        cls.c = kvshade.Client(cls.server.target, timeout=30)
        cls.c.wait_ready(20)

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        rc = cls.server.stop()
        assert rc == 0, "server exit code %d" % rc

    def kv(self, n):
        k = self.rng.standard_normal((L, n, H, D)).astype(np.float32)
        v = self.rng.standard_normal((L, n, H, D)).astype(np.float32)
        return k, v

    def make_session(self, profile, n, dtype="bf16", name="py-test"):
        tokens = self.rng.integers(0, 30000, n)
        k, v = self.kv(n)
        created = self.c.create_session(model(dtype, name), profile, tokens, label="unit")
        self.assertEqual(created.tokens_to_ingest, n)
        with self.c.ingest(created.session_id, dtype) as ing:
            for l in range(L):
                ing.layer(l, k[l], v[l])
            self.assertEqual(ing.commit(), n)
        return created, tokens, k, v

    def test_library_and_health(self):
        if os.environ.get("KVSHADE_LIB"):
            self.assertEqual(kvshade.library_path(), os.environ["KVSHADE_LIB"])
        self.assertTrue(self.c.healthy())
        st = self.c.stats()
        self.assertEqual(st["backend"], "cpu")
        self.assertTrue(st["version"])

    def test_a_daemon_with_one_device(self):
        # device_stats: the one device, with stats()'s figures. It answers to its name and
        # (a lone cpu or cuda) to ":0" of it, and refuses a PCI bus id that is not its GPU's
        # (a CPU device has none): why the adapters give a daemon with one device no device.
        devs = self.c.device_stats()
        self.assertEqual(len(devs), 1)
        name, st = devs[0]["device"], self.c.stats()
        for key in ("sessions", "attachments", "segments", "device_bytes_used", "device_bytes_budget",
                    "host_bytes_used", "host_bytes_budget", "prefix_lookups", "prefix_hits"):
            self.assertEqual(devs[0][key], st[key], key)
        tokens = self.rng.integers(0, 30000, 64)
        spec = model(name="py-one-device")
        for dev in (name, name if ":" in name else name + ":0"):
            created = self.c.create_session(spec, kvshade.Profile("exact"), tokens, device=dev)
            self.assertEqual(created.device, name)
            self.c.close_session(created.session_id)
        with self.assertRaises(kvshade.InvalidArgument) as e:
            self.c.create_session(spec, kvshade.Profile("exact"), tokens, device="0000:ff:1f.0")
        self.assertIn("is not one of this daemon's devices (%s" % name, str(e.exception))

    def test_bf16_rounding_matches_torch(self):
        try:
            import torch
        except ImportError:
            self.skipTest("torch not installed")
        x = self.rng.standard_normal(4096).astype(np.float32) * 100
        ours = kvshade.f32_to_bf16_bits(x)
        theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(ours, theirs)
        # torch tensors in: bf16 tensors go as raw bits, fp32 tensors are rounded the same way.
        np.testing.assert_array_equal(kvshade.to_wire(torch.from_numpy(x).to(torch.bfloat16), "bf16"), ours)
        np.testing.assert_array_equal(kvshade.to_wire(torch.from_numpy(x), "bf16"), ours)

    def test_exact_roundtrip_attend_append(self):
        n = 80
        created, tokens, k, v = self.make_session(kvshade.Profile("exact"), n)
        self.assertEqual(created.effective_profile, "exact")
        info = self.c.get_session(created.session_id)
        self.assertEqual(info["state"], "ready")
        self.assertEqual(info["tokens"], n)
        self.assertEqual(info["label"], "unit")
        att = self.c.attach(created.session_id, "py-worker")
        for layer in range(L):
            st = self.c.static_set(att.attachment_id, layer)
            self.assertEqual(st.tail_k.shape, (n, H, D))
            np.testing.assert_array_equal(st.tail_positions, np.arange(n))  # row t is token t
            # Values come back bit-identical to the bf16 that went in.
            np.testing.assert_array_equal(st.tail_v, bf16(v[layer]))
            q = bf16(self.rng.standard_normal((HQ, D)).astype(np.float32))
            out = self.c.attend(layer, [att.attachment_id], q)
            self.assertEqual(out.shape, (1, HQ, D))
            g = HQ // H
            for hq in range(HQ):
                logits = st.tail_k[:, hq // g] @ q[hq] / np.sqrt(D)
                p = np.exp(logits - logits.max())
                ref = (p / p.sum()) @ st.tail_v[:, hq // g]
                np.testing.assert_allclose(out[0, hq], ref, atol=2e-3)
        ak, av = self.kv(3)
        self.assertEqual(self.c.append(created.session_id, [1, 2, 3], ak, av), n + 3)
        self.assertEqual(self.c.get_session(created.session_id)["tokens"], n + 3)
        self.c.detach(att.attachment_id)
        self.c.close_session(created.session_id)
        with self.assertRaises(kvshade.NotFound):
            self.c.get_session(created.session_id)

    def test_staged_decode_step_equals_append(self):
        # One decode step staged layer by layer (select for layer 1, attend for layer 0,
        # which comes last and appends), against a twin session that gets the same token
        # by append(): the same attention answers, bit for bit, and LSE/lengths come back.
        n = 96
        profile = kvshade.Profile("shadow", rank=16, chunk_size=8, sparse_budget=4, outliers=2, local_window=16)
        tokens = self.rng.integers(0, 30000, n)
        k, v = self.kv(n)
        twins = []
        for name in ("py-staged", "py-staged-twin"):  # separate prefix namespaces: no reuse
            created = self.c.create_session(model(name=name), profile, tokens)
            with self.c.ingest(created.session_id) as ing:
                for l in range(L):
                    ing.layer(l, k[l], v[l])
                ing.commit()
            twins.append(created)
        a, b = twins
        w = self.c.attach(a.session_id, "writer", writer=True)
        rb = self.c.attach(b.session_id, "reader")
        nk, nv = self.kv(1)  # [L, 1, H, D]
        q = bf16(self.rng.standard_normal((1, HQ, D)).astype(np.float32))
        with self.assertRaises(kvshade.InvalidArgument):  # a select's new token must be staged
            self.c.select(1, [w.attachment_id], q, k_new=nk[1], v_new=nv[1])
        (d1,) = self.c.select(1, [w.attachment_id], q, k_new=nk[1], v_new=nv[1], stage_token_ids=[777])
        self.assertEqual(d1.tokens, n)
        out, lse, lengths = self.c.attend(0, [w.attachment_id], q, k_new=nk[0], v_new=nv[0],
                                          stage_token_ids=[777], with_lse=True)
        self.assertEqual(out.shape, (1, HQ, D))
        self.assertEqual(lse.shape, (1, HQ))
        self.assertTrue(np.isfinite(lse).all())
        self.assertEqual(list(lengths), [n + 1])
        self.assertEqual(self.c.get_session(a.session_id)["tokens"], n + 1)
        self.assertEqual(self.c.append(b.session_id, [777], nk, nv), n + 1)
        ra = self.c.attach(a.session_id, "reader")
        for layer in range(L):
            qq = bf16(self.rng.standard_normal((1, HQ, D)).astype(np.float32))
            np.testing.assert_array_equal(self.c.attend(layer, [ra.attachment_id], qq),
                                          self.c.attend(layer, [rb.attachment_id], qq))
        # A held token (stage_hold): complete but not appended until commit_staged; a
        # discarded one never is.
        nk2, nv2 = self.kv(1)
        for layer in range(L):
            self.c.select(layer, [w.attachment_id], q, k_new=nk2[layer], v_new=nv2[layer], stage_token_ids=[778],
                          stage_hold=True)
        self.assertEqual(self.c.get_session(a.session_id)["tokens"], n + 1)
        with self.assertRaises(kvshade.InvalidArgument):  # holding needs a staged token
            self.c.attend(0, [w.attachment_id], q, stage_hold=True)
        self.assertEqual(self.c.commit_staged(w.attachment_id, 778), n + 2)
        self.assertEqual(self.c.append(b.session_id, [778], nk2, nv2), n + 2)
        for layer in range(L):
            self.c.attend(layer, [w.attachment_id], q, k_new=nk[layer], v_new=nv[layer], stage_token_ids=[779],
                          stage_hold=True)
        self.assertEqual(self.c.commit_staged(w.attachment_id, 779, discard=True), n + 2)
        with self.assertRaises(kvshade.FailedPrecondition):
            self.c.commit_staged(w.attachment_id, 779)
        self.assertEqual(self.c.get_session(a.session_id)["tokens"], n + 2)
        for layer in range(L):
            qq = bf16(self.rng.standard_normal((1, HQ, D)).astype(np.float32))
            np.testing.assert_array_equal(self.c.attend(layer, [ra.attachment_id], qq),
                                          self.c.attend(layer, [rb.attachment_id], qq))
        for att in (w, ra, rb):
            self.c.detach(att.attachment_id)
        self.c.close_session(a.session_id)
        self.c.close_session(b.session_id)

    def test_zero_is_a_value_and_none_the_default(self):
        # outliers=0 (and no sink): an empty static set; outliers left out: the server's 48
        # (capped by the chunk count) fill it.
        n = 256
        base = dict(rank=16, chunk_size=8, sparse_budget=4, local_window=16, keep_sink=False)
        for outliers, expect_empty in ((0, True), (None, False)):
            created, _, _, _ = self.make_session(kvshade.Profile("shadow", outliers=outliers, **base), n,
                                                 name="py-outliers-%s" % outliers)
            att = self.c.attach(created.session_id, "w")
            st = self.c.static_set(att.attachment_id, 0)
            if expect_empty:
                self.assertEqual(int(st.lengths.sum()), 0, "outliers=0 must leave no static chunks")
            else:
                self.assertGreater(int(st.lengths.min()), 0)
                # Static rows are whole chunks: C consecutive positions from a multiple of C
                # (one segment); the tail ends at the last token.
                for hh in range(H):
                    rows = st.positions[hh, :int(st.lengths[hh])].reshape(-1, 8)
                    np.testing.assert_array_equal(rows - rows[:, :1], np.tile(np.arange(8), (len(rows), 1)))
                    self.assertTrue(((rows[:, 0] % 8) == 0).all())
                    self.assertTrue((st.positions[hh, int(st.lengths[hh]):] == -1).all())
                self.assertEqual(int(st.tail_positions[-1]), n - 1)
            self.c.detach(att.attachment_id)
            self.c.close_session(created.session_id)

    def test_selection_options_reach_the_daemon(self):
        # Budgets by attention mass: a cap of 8 chunks per head, a floor of 1 and p = 0.01
        # keep fewer chunks than the cap (the best chunk alone carries more than 1% of the
        # estimated mass: there are 60 chunks); a floor equal to the cap keeps all 8.
        n = 512
        base = dict(rank=16, chunk_size=8, sparse_budget=8, outliers=2, local_window=16)
        q = bf16(self.rng.standard_normal((1, HQ, D)).astype(np.float32))
        selected = {}
        for floor in (1, 8):
            created, _, _, _ = self.make_session(
                kvshade.Profile("shadow", mass_top_p=0.01, mass_min_chunks=floor, rerank_factor=2,
                                recall_sample_rate=0.0, recall_action="report", **base), n,
                name="py-selopts-%d" % floor)
            att = self.c.attach(created.session_id, "w")
            (delta,) = self.c.select(0, [att.attachment_id], q)
            selected[floor] = delta.selected
            self.c.detach(att.attachment_id)
            self.c.close_session(created.session_id)
        self.assertEqual(selected[8], 8 * H)
        self.assertGreaterEqual(selected[1], H)
        self.assertLess(selected[1], 8 * H)
        # Out-of-range values are the daemon's refusals, naming the field.
        for bad, field in ((dict(rerank_factor=65), "rerank_factor"), (dict(mass_top_p=1.5), "mass_top_p"),
                           (dict(recall_floor=2.0), "recall_floor"), (dict(recall_sample_rate=-1.0),
                                                                      "recall_sample_rate")):
            with self.assertRaisesRegex(kvshade.InvalidArgument, field):
                self.c.create_session(model("bf16", "py-selopts-bad"), kvshade.Profile("shadow", **bad, **base),
                                      self.rng.integers(0, 30000, 64))
        with self.assertRaisesRegex(kvshade.InvalidArgument, "recall_action"):
            kvshade.Profile("shadow", recall_action="sometimes")._c()

    def test_key_signatures_reach_the_daemon(self):
        # Profile(key_signature_bits=2): the daemon keeps 2-bit key signatures of every
        # chunked token, H * (D*2/8 + 4) device bytes per token and layer beside the same
        # profile without them; two-stage selection (rerank_factor 4) selects with them.
        n = 512
        base = dict(rank=16, chunk_size=8, sparse_budget=4, outliers=2, local_window=16, rerank_factor=4)
        q = bf16(self.rng.standard_normal((1, HQ, D)).astype(np.float32))
        gpu = {}
        for bits in (0, 2, 8):
            created, _, _, _ = self.make_session(kvshade.Profile("shadow", key_signature_bits=bits, **base), n,
                                                 name="py-sig-%d" % bits)
            gpu[bits] = self.c.get_session(created.session_id)["gpu_bytes"]
            att = self.c.attach(created.session_id, "w")
            (delta,) = self.c.select(0, [att.attachment_id], q)
            self.assertEqual(delta.selected, 4 * H)
            self.c.detach(att.attachment_id)
            self.c.close_session(created.session_id)
        chunked_rows = (n - 16) // 8 * 8
        self.assertEqual(gpu[2] - gpu[0], L * chunked_rows * H * (D * 2 // 8 + 4))
        self.assertEqual(gpu[8] - gpu[0], L * chunked_rows * H * (D + 4))
        # 1, 3 and 5 bits are refused, and so is a mini profile asking for signatures.
        for bad in (dict(key_signature_bits=1, **base), dict(key_signature_bits=3, **base),
                    dict(key_signature_bits=5, **base)):
            with self.assertRaisesRegex(kvshade.InvalidArgument, "key_signature_bits"):
                self.c.create_session(model("bf16", "py-sig-bad"), kvshade.Profile("shadow", **bad),
                                      self.rng.integers(0, 30000, 64))
        with self.assertRaisesRegex(kvshade.InvalidArgument, "key_signature_bits"):
            self.c.create_session(model("bf16", "py-sig-mini"), kvshade.Profile("mini", key_signature_bits=2),
                                  self.rng.integers(0, 30000, 64))

    def test_layer_parts_may_interleave_across_layers(self):
        # A chunked prefill's ingest: each chunk's part of every layer in turn (uneven
        # chunks), against the same K/V sent one whole layer at a time. The sessions are the
        # same: the same device bytes, and a select delivers the same chunks, keys and values.
        n, cuts = 512, (0, 100, 256, 512)
        prof = kvshade.Profile("shadow", rank=16, chunk_size=8, sparse_budget=4, outliers=2, local_window=32)
        tokens = self.rng.integers(0, 30000, n)
        k, v = self.kv(n)
        ids = []
        for way in ("whole", "parts"):
            created = self.c.create_session(model(name="py-parts-" + way), prof, tokens, label="unit")
            with self.c.ingest(created.session_id) as ing:
                if way == "whole":
                    for l in range(L):
                        ing.layer(l, k[l], v[l])
                else:
                    for a, b in zip(cuts, cuts[1:]):
                        for l in range(L):
                            ing.layer(l, k[l, a:b], v[l, a:b], token_offset=a, last_part=b == n)
                    # GetSession counts the parts the open stream has placed (a worker frees
                    # a part sent from its GPU once counted).
                    deadline = time.monotonic() + 30
                    while self.c.get_session(created.session_id)["ingest_parts_taken"] < 3 * L:
                        self.assertLess(time.monotonic(), deadline)
                        time.sleep(0.01)
                    self.assertEqual(self.c.get_session(created.session_id)["ingest_parts_taken"], 3 * L)
                self.assertEqual(ing.commit(), n)
                self.assertEqual(self.c.get_session(created.session_id)["ingest_parts_taken"], 0)
            ids.append(created.session_id)
        info = [self.c.get_session(i) for i in ids]
        self.assertEqual(info[0]["gpu_bytes"], info[1]["gpu_bytes"])
        q = bf16(self.rng.standard_normal((1, HQ, D)).astype(np.float32))
        deltas = []
        for sid in ids:
            att = self.c.attach(sid, "w")
            (d,) = self.c.select(0, [att.attachment_id], q)
            deltas.append(d)
            self.c.detach(att.attachment_id)
        for f in ("chunk", "head", "slot", "position", "keys", "values"):
            np.testing.assert_array_equal(getattr(deltas[0], f), getattr(deltas[1], f), err_msg=f)
        for sid in ids:
            self.c.close_session(sid)
        # A part out of order, or a last_part that does not complete its layer, fails the
        # stream naming the layer; nothing is committed.
        created = self.c.create_session(model(name="py-parts-bad"), prof, tokens, label="unit")
        for bad in ((dict(token_offset=8), "token_offset must be 0"),
                    (dict(token_offset=0, last_part=True), "last_part is set but the layer has 100 of 512")):
            with self.assertRaisesRegex(kvshade.InvalidArgument, bad[1]):
                with self.c.ingest(created.session_id) as ing:
                    ing.layer(0, k[0, :100], v[0, :100], **bad[0])
                    ing.commit()
            self.assertEqual(self.c.get_session(created.session_id)["state"], "ingesting")
        self.c.close_session(created.session_id)

    def test_segment_ends_reuse_the_document(self):
        doc, n = 256, 600  # the question holds a whole block: both segments are cached
        prof = kvshade.Profile("shadow", rank=16, chunk_size=8, sparse_budget=4, outliers=2, local_window=32)
        spec = model(name="py-ends")
        tokens = self.rng.integers(0, 30000, n)
        with self.assertRaisesRegex(kvshade.InvalidArgument, "multiple of 256"):
            self.c.create_session(spec, prof, tokens, segment_ends=[200])
        self.assertEqual(self.c.lookup_prefix(spec, prof, tokens), (0, 0))
        created = self.c.create_session(spec, prof, tokens, segment_ends=[doc])
        self.assertEqual((created.segment_ends, created.automatic_segment_end), ((doc,), 0))
        k, v = self.kv(n)
        with self.c.ingest(created.session_id) as ing:
            for l in range(L):
                ing.layer(l, k[l], v[l])
            self.assertEqual(ing.commit(), n)
        self.assertEqual(self.c.lookup_prefix(spec, prof, tokens), (n, 2))
        other = np.array(tokens, copy=True)
        other[doc:] += 1  # the same document, another question
        second = self.c.create_session(spec, prof, other, segment_ends=[doc])
        self.assertEqual((second.reused_tokens, second.tokens_to_ingest), (doc, n - doc))
        self.assertEqual(second.segment_ends, ())
        for sid in (second.session_id, created.session_id):
            self.c.close_session(sid)

    def test_shadow_prefix_fork_select(self):
        n = 256
        prof = kvshade.Profile("shadow", rank=16, chunk_size=8, sparse_budget=4, outliers=2, local_window=32)
        created, tokens, k, v = self.make_session(prof, n, name="py-shadow")
        self.assertEqual(created.effective_profile, "shadow")
        # The whole committed prompt (one segment of 256 tokens) is reusable by the same
        # tokens; a prompt that differs in its last token reuses nothing (a segment is reused
        # whole or not at all).
        reusable, segments = self.c.lookup_prefix(model(name="py-shadow"), prof, tokens)
        self.assertEqual((reusable, segments), (n, 1))
        other = np.array(tokens, copy=True)
        other[-1] += 1
        self.assertEqual(self.c.lookup_prefix(model(name="py-shadow"), prof, other), (0, 0))
        child, shared = self.c.fork_session(created.session_id, n)
        self.assertEqual(shared, n)
        self.assertNotEqual(child, created.session_id)
        att = self.c.attach(child, "py-fork")
        self.assertEqual(att.slots_per_head, 4)
        self.assertEqual(att.chunk_size, 8)
        q = self.rng.standard_normal((1, HQ, D)).astype(np.float32)
        (d1,) = self.c.select(0, [att.attachment_id], q)
        self.assertEqual(d1.attachment_id, att.attachment_id)
        m = len(d1.head)
        self.assertGreater(m, 0)
        self.assertLessEqual(m, H * 4)
        self.assertEqual(d1.keys.shape, (m, 8, D))
        self.assertEqual(d1.values.shape, (m, 8, D))
        self.assertTrue(np.isfinite(d1.keys).all())
        self.assertTrue((d1.slot < 4).all() and (d1.head < H).all())
        # Values of a selected chunk are the ingested values (bf16) of its tokens, which its
        # position names (one segment here: chunk c starts at token 8c).
        self.assertEqual(d1.position.shape, (m,))
        for i in range(m):
            c, hh, p = int(d1.chunk[i]), int(d1.head[i]), int(d1.position[i])
            self.assertEqual(p, 8 * c)
            np.testing.assert_array_equal(d1.values[i], bf16(v[0, p:p + 8, hh]))
        # The same query again: everything hits, nothing moves.
        (d2,) = self.c.select(0, [att.attachment_id], q)
        self.assertEqual(len(d2.head), 0)
        self.assertEqual(d2.hits, d2.selected)
        # A second attachment misses the same chunks; rows="wire" gives their rows as the
        # daemon sent them (bf16 bits, no widening), the same values.
        att2 = self.c.attach(child, "py-fork-wire")
        (dw,) = self.c.select(0, [att2.attachment_id], q, rows="wire")
        self.assertEqual(dw.rows_dtype, "bf16")
        self.assertEqual(dw.keys.dtype, np.uint16)
        np.testing.assert_array_equal(dw.chunk, d1.chunk)
        np.testing.assert_array_equal(kvshade.bf16_bits_to_f32(dw.keys), d1.keys)
        np.testing.assert_array_equal(kvshade.bf16_bits_to_f32(dw.values), d1.values)
        st, sw = self.c.static_set(att.attachment_id, 0), self.c.static_set(att2.attachment_id, 0, rows="wire")
        self.assertEqual((st.rows_dtype, sw.rows_dtype), ("float32", "bf16"))
        for a, b in ((st.k, sw.k), (st.v, sw.v), (st.tail_k, sw.tail_k), (st.tail_v, sw.tail_v)):
            np.testing.assert_array_equal(kvshade.bf16_bits_to_f32(b), a)
        with self.assertRaises(kvshade.InvalidArgument):
            self.c.select(0, [att2.attachment_id], q, rows="bf16")
        self.c.detach(att2.attachment_id)
        self.c.detach(att.attachment_id)
        self.c.close_session(child)
        self.c.close_session(created.session_id)

    def test_session_selection(self):
        # The recall guard's figures per layer (GetSession with include_selection), worst
        # mean recall first. A floor of 1 at a budget of one chunk acts after a full window
        # of 4 sampled steps: widen (twice the budget, a fallback the select's delta says);
        # a layer with 2 samples is counted, not acted on; no guard, no figures.
        n = 256
        base = dict(rank=16, chunk_size=8, sparse_budget=1, outliers=2, local_window=16)
        created, _, _, _ = self.make_session(
            kvshade.Profile("shadow", recall_sample_rate=1.0, recall_floor=1.0, recall_action="widen", **base), n,
            name="py-guard")
        sid = created.session_id
        self.assertEqual(self.c.session_selection(sid), [])
        att = self.c.attach(sid, "w")
        fallback = {}
        for layer, steps in ((0, 4), (1, 2)):
            for _ in range(steps):
                q = self.rng.standard_normal((1, HQ, D)).astype(np.float32)
                (delta,) = self.c.select(layer, [att.attachment_id], q)
            fallback[layer] = delta.fallback
        recs = self.c.session_selection(sid)
        self.assertEqual([r["recall"] for r in recs], sorted(r["recall"] for r in recs))
        by_layer = {r["layer"]: r for r in recs}
        self.assertEqual(sorted(by_layer), [0, 1])
        for r in recs:
            self.assertEqual(set(r), {"layer", "samples", "recall", "recent_recall", "budget", "fallback", "actions"})
            self.assertTrue(0 <= r["recall"] <= 1 and 0 <= r["recent_recall"] <= 1, r)
        l0, l1 = by_layer[0], by_layer[1]
        self.assertEqual((l0["samples"], l1["samples"]), (4, 2))
        self.assertLess(l0["recall"], 1.0)  # one chunk of about 30 against the oracle's: below the floor
        self.assertEqual((l0["fallback"], l0["budget"], l0["actions"]), ("widen", 2, 1))
        self.assertEqual(l0["recent_recall"], l0["recall"])  # the window starts anew after acting
        self.assertEqual((l1["fallback"], l1["budget"], l1["actions"]), (None, 0, 0))
        # The step on which the guard acted was served from the slots; the layer's next
        # select is a fallback: nothing selected or delivered, and it is not sampled.
        self.assertEqual(fallback, {0: False, 1: False})
        (delta,) = self.c.select(0, [att.attachment_id], self.rng.standard_normal((1, HQ, D)).astype(np.float32))
        self.assertTrue(delta.fallback)
        self.assertEqual((len(delta.head), delta.selected), (0, 0))
        self.assertEqual({r["layer"]: r["samples"] for r in self.c.session_selection(sid)}, {0: 4, 1: 2})
        self.c.detach(att.attachment_id)
        self.c.close_session(sid)
        # Without the guard: nothing sampled.
        created, _, _, _ = self.make_session(kvshade.Profile("shadow", recall_sample_rate=0.0, **base), n,
                                             name="py-guard-off")
        att = self.c.attach(created.session_id, "w")
        self.c.select(0, [att.attachment_id], self.rng.standard_normal((1, HQ, D)).astype(np.float32))
        self.assertEqual(self.c.session_selection(created.session_id), [])
        self.c.detach(att.attachment_id)
        self.c.close_session(created.session_id)
        with self.assertRaises(kvshade.NotFound):
            self.c.session_selection("no-such-session")

    def test_model_native_select(self):
        # The caller names the chunks (a model's own indexer); kvshade serves them into the
        # slot tables: the deltas carry exactly those chunks (the sink, chunk 0, is static
        # and skipped), their values are the ingested ones, and a repeat is refused.
        n = 256
        prof = kvshade.Profile("shadow", rank=16, chunk_size=8, sparse_budget=4, outliers=1, local_window=32)
        created, tokens, k, v = self.make_session(prof, n, name="py-native")
        att = self.c.attach(created.session_id, "py-native")
        chunks = np.array([[5, 9, -1], [0, 12, 7]], np.int32)
        (d,) = self.c.select_chunks(1, [att.attachment_id], chunks)
        got = {(int(h), int(c)) for h, c in zip(d.head, d.chunk)}
        want = {(0, 5), (0, 9), (1, 12), (1, 7)}
        # An outlier chunk (static for its head) would be skipped too: at most one per head.
        self.assertTrue(got <= want and len(got) >= 2, got)
        for i in range(len(d.head)):
            c, h = int(d.chunk[i]), int(d.head[i])
            np.testing.assert_array_equal(d.values[i], bf16(v[1, c * 8:(c + 1) * 8, h]))
        (again,) = self.c.select_chunks(1, [att.attachment_id], chunks)
        self.assertEqual(len(again.head), 0)
        self.assertEqual(again.hits, again.selected)
        with self.assertRaises(kvshade.InvalidArgument):
            self.c.select_chunks(1, [att.attachment_id], np.array([[5, 5, -1], [1, 2, 3]], np.int32))
        self.c.detach(att.attachment_id)
        self.c.close_session(created.session_id)

    def test_errors_map_to_exceptions(self):
        with self.assertRaises(kvshade.NotFound) as cm:
            self.c.get_session("no-such-session")
        self.assertEqual(cm.exception.code, 5)
        self.assertIsInstance(cm.exception, LookupError)
        self.assertTrue(str(cm.exception))
        with self.assertRaises(kvshade.NotFound):
            self.c.attach("no-such-session")
        bad = kvshade.ModelSpec("bad", num_layers=L, num_query_heads=3, num_kv_heads=2, head_dim=D)
        with self.assertRaises(kvshade.InvalidArgument) as cm:
            self.c.create_session(bad, kvshade.Profile("exact"), [1, 2, 3])
        self.assertIsInstance(cm.exception, ValueError)
        self.assertEqual(cm.exception.code, 3)
        # A layer of the wrong head count: the server refuses the stream.
        created = self.c.create_session(model(), kvshade.Profile("exact"), list(range(40)))
        with self.assertRaises(kvshade.InvalidArgument):
            with self.c.ingest(created.session_id) as ing:
                k = np.ones((40, H + 1, D), np.float32)
                ing.layer(0, k, k)
                ing.layer(1, k, k)
                ing.commit()
        # Nothing was committed; the session can still be ingested.
        self.assertEqual(self.c.get_session(created.session_id)["state"], "ingesting")
        with self.assertRaises(kvshade.InvalidArgument):
            self.c.ingest(created.session_id).layer(0, np.ones((4, 2)), np.ones((4, 2)))
        with self.assertRaises(kvshade.InvalidArgument):
            kvshade.Profile("bogus")._c()
        # Select on a session still ingesting: attaching is allowed, select refuses with
        # FAILED_PRECONDITION naming the state.
        att = self.c.attach(created.session_id)
        with self.assertRaises(kvshade.FailedPrecondition) as cm:
            self.c.select(0, [att.attachment_id], np.ones((HQ, D), np.float32))
        self.assertIn("ingesting", str(cm.exception))
        self.c.close_session(created.session_id)

    def test_non_finite_values_are_refused_naming_the_tensor_and_index(self):
        # A NaN or infinity anywhere in a part fails the stream with INVALID_ARGUMENT naming
        # the layer, the tensor and the flat index, commits nothing, and a clean stream
        # still commits. (On a CUDA daemon the values are checked on the device.)
        n = 64
        shadow = kvshade.Profile("shadow", rank=16, chunk_size=8, outliers=2, local_window=16)
        for profile, bad_value, tensor in ((shadow, np.nan, "v"), (kvshade.Profile("exact"), np.inf, "k")):
            tokens = self.rng.integers(0, 30000, n)
            k, v = self.kv(n)
            created = self.c.create_session(model(), profile, tokens)
            t, h, d = 37, 1, 5
            flat = (t * H + h) * D + d
            bad_k, bad_v = k.copy(), v.copy()
            (bad_v if tensor == "v" else bad_k)[1, t, h, d] = bad_value
            with self.assertRaises(kvshade.InvalidArgument) as cm:
                with self.c.ingest(created.session_id) as ing:
                    for l in range(L):
                        ing.layer(l, bad_k[l], bad_v[l])
                    ing.commit()
            self.assertIn("layer 1 %s holds a non-finite value at flat index %d" % (tensor, flat),
                          str(cm.exception))
            self.assertEqual(self.c.get_session(created.session_id)["state"], "ingesting")
            with self.c.ingest(created.session_id) as ing:
                for l in range(L):
                    ing.layer(l, k[l], v[l])
                self.assertEqual(ing.commit(), n)
            self.c.close_session(created.session_id)

    def test_package_loads_library_next_to_it(self):
        # A copy of the package with libkvshade.so inside it, in a fresh interpreter without
        # KVSHADE_LIB: the library next to the package is found and works.
        with tempfile.TemporaryDirectory() as d:
            pkg = os.path.join(d, "kvshade")
            shutil.copytree(os.path.dirname(kvshade.__file__), pkg,
                            ignore=shutil.ignore_patterns("__pycache__"))
            shutil.copy(kvshade.library_path(), os.path.join(pkg, "libkvshade.so"))
            env = {k: v for k, v in os.environ.items() if k not in ("KVSHADE_LIB", "PYTHONPATH")}
            code = ("import kvshade; c = kvshade.Client(%r); print(kvshade.library_path()); print(c.healthy())"
                    % self.server.target)
            out = subprocess.run([sys.executable, "-c", code], cwd=d, env=env, capture_output=True, text=True,
                                 timeout=60)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertEqual(out.stdout.split(), [os.path.join(pkg, "libkvshade.so"), "True"])

    def test_unreachable_server(self):
        c = kvshade.Client("127.0.0.1:1", timeout=2)
        with self.assertRaises((kvshade.Unavailable, kvshade.DeadlineExceeded)):
            c.get_session("x")
        c.close()
        with self.assertRaises(kvshade.InvalidArgument):
            c.get_session("x")

    def test_healthy_is_false_when_nothing_listens(self):
        # A port bound by this process but not listening: connections to it are refused,
        # and no other process can take it while the test runs.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            with kvshade.Client("127.0.0.1:%d" % s.getsockname()[1], timeout=2) as c:
                self.assertIs(c.healthy(), False)
                with self.assertRaises((kvshade.DeadlineExceeded, kvshade.Unavailable)):
                    c.wait_ready(0.2)  # waiting still raises
        self.assertIs(self.c.healthy(), True)


if __name__ == "__main__":
    unittest.main()
