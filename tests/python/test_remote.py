"""kvshade.decoders.remote.RemoteDecoder against real kvshade-servers: for every slot delivery the
daemon can grant here ("inline" over gRPC; "ucx_rma" over a UCX data plane on tcp; and
"cuda_ipc" where a CUDA daemon and a GPU are at hand), its batched attention equals the
per-head reference of kvshade.integrations.torch_hook (same session, same queries, same new tokens) and,
without new tokens, the daemon's own Attend; a batch equals each session alone; exact
sessions in the batch are served from their tail; a layer the recall guard puts under a
fallback is attended through the daemon's Attend merged with the tokens decoded here
(equal to kvshade.testing's reference over the daemon's own rows); the decoder follows
kvshade.decoders.base.Decoder; sequences join and leave between steps (each equal to a decoder
over its session alone); bad calls are refused."""
import contextlib
import os
import re
import socket
import tempfile
import unittest
import urllib.request

import numpy as np
import torch

from kvshade_testutil import Server, seed

import kvshade
from kvshade.decoders.base import Decoder
from kvshade.decoders.remote import RemoteDecoder
from kvshade.testing import attention, merge_attention
from kvshade.integrations.torch_hook import KvShadeKVCache

L, HQ, H, D, N = 2, 4, 2, 64, 512  # d 64: a head dim the CUDA backend has kernels for


@contextlib.contextmanager
def daemon(ucx):
    if not ucx:
        with Server() as server:
            yield server
        return
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as cfg:
        cfg.write('ucx:\n  enable: true\n  transports: "tcp,self"\n')
        cfg.flush()
        with Server("-c", cfg.name) as server:
            yield server


def device():
    return "cuda" if torch.cuda.is_available() and os.environ.get("KVSHADE_TEST_BACKEND") == "cuda" else "cpu"


class RemoteDecoderTest(unittest.TestCase):
    def setUp(self):
        self.rng = np.random.default_rng(seed())
        self.model = kvshade.ModelSpec("py-remote", L, HQ, H, D)
        self.shadow = kvshade.Profile("shadow", rank=16, chunk_size=8, sparse_budget=8, outliers=4, local_window=32)

    def units(self):
        """Selection units of 2 tokens (two stages): 8 chunks' worth of tokens, 32 units per head."""
        return kvshade.Profile("shadow", rank=16, chunk_size=8, sparse_budget=8, outliers=4, local_window=32,
                               rerank_factor=4, selection_unit=2)

    def session(self, c, profile=None, n=N):
        ids = self.rng.integers(0, 30000, n)
        s = c.create_session(self.model, profile or self.shadow, ids)
        with c.ingest(s.session_id) as ing:
            for l in range(L):
                ing.layer(l, self.rng.standard_normal((n, H, D)), self.rng.standard_normal((n, H, D)))
            ing.commit()
        return s.session_id

    def steps(self, n_steps, batch):
        """Random decode inputs: per step and layer q [B, hq, d], k, v [B, h, d] (bf16-exact)."""
        out = []
        for _ in range(n_steps):
            per_layer = []
            for _ in range(L):
                q = torch.randn(batch, HQ, D).bfloat16().float() * 2
                k = torch.randn(batch, H, D).bfloat16().float()
                v = torch.randn(batch, H, D).bfloat16().float()
                per_layer.append((q, k, v))
            out.append(per_layer)
        return out

    def check_against_reference(self, client, delivery, local_capacity=256, profile=None):
        profile = profile or self.shadow
        sids = [self.session(client, profile), self.session(client, profile)]
        dev = device()
        refs = []
        for sid in sids:
            r = KvShadeKVCache(client, self.model, profile, worker_id="reference")
            r.attach(sid)
            refs.append(r)
        with RemoteDecoder(client, sids, self.model, device=dev, delivery=delivery,
                           local_capacity=local_capacity) as dec:
            self.assertEqual(dec.delivery, delivery)
            if profile.selection_unit:
                # Slots of units: slots_per_head units of slot_tokens rows each.
                self.assertEqual((dec.slot_tokens, dec.slots_per_head), (2, 32))
                self.assertEqual(tuple(dec._slot_k.shape[-3:]), (32, 2, D))
            for step in self.steps(6, 2):
                for layer, (q, k, v) in enumerate(step):
                    out = dec.attend(layer, q.to(dev), k.to(dev), v.to(dev)).cpu()
                    self.assertEqual(tuple(out.shape), (2, HQ, D))
                    for b, r in enumerate(refs):
                        want = r.attend(layer, q[b], k[b], v[b])
                        # CUDA: attention over the bf16 rows in bf16 (fp32 softmax), the output
                        # rounded to bf16: within a few bf16 ulps of outputs of magnitude <= ~1.
                        tol = 2e-5 if dev == "cpu" else 2e-2
                        torch.testing.assert_close(out[b], want, rtol=tol, atol=tol)
            st = dec.stats()
            self.assertEqual(st["selected"], sum(r.selected for r in refs))
            self.assertEqual(st["hits"], sum(r.hits for r in refs))
            self.assertGreater(st["selected"] - st["hits"], 0)  # misses moved
            self.assertGreater(st["hits"], 0)                   # and slots were reused
        for r in refs:
            r.close()
        self.assertEqual(client.get_session(sids[0])["attachments"], 0)  # the decoder detached

    def test_inline_equals_the_reference(self):
        with daemon(ucx=False) as server, kvshade.Client(server.target, timeout=30) as c:
            c.wait_ready(20)
            # room for 2 local tokens: 6 steps grow the working buffers twice
            self.check_against_reference(c, "inline", local_capacity=2)

    def test_ucx_rma_equals_the_reference(self):
        with daemon(ucx=True) as server, \
                kvshade.Client(server.target, timeout=30, use_ucx=True, ucx_transports="tcp,self") as c:
            c.wait_ready(20)
            self.check_against_reference(c, "ucx_rma")
            self.assertEqual(c.ucx_fallbacks, 0)

    def test_selection_units_inline_equals_the_reference(self):
        with daemon(ucx=False) as server, kvshade.Client(server.target, timeout=30) as c:
            c.wait_ready(20)
            self.check_against_reference(c, "inline", profile=self.units())

    def test_selection_units_ucx_rma_equals_the_reference(self):
        with daemon(ucx=True) as server, \
                kvshade.Client(server.target, timeout=30, use_ucx=True, ucx_transports="tcp,self") as c:
            c.wait_ready(20)
            self.check_against_reference(c, "ucx_rma", profile=self.units())
            self.assertEqual(c.ucx_fallbacks, 0)

    @unittest.skipUnless(device() == "cuda", "cuda_ipc needs a CUDA daemon and a GPU (KVSHADE_TEST_BACKEND=cuda)")
    def test_cuda_ipc_equals_the_reference(self):
        with daemon(ucx=True) as server, \
                kvshade.Client(server.target, timeout=30, use_ucx=True) as c:
            c.wait_ready(20)
            self.check_against_reference(c, "cuda_ipc")

    def test_auto_picks_a_granted_delivery(self):
        with daemon(ucx=True) as server, \
                kvshade.Client(server.target, timeout=30, use_ucx=True, ucx_transports="tcp,self") as c:
            c.wait_ready(20)
            sid = self.session(c)
            with RemoteDecoder(c, [sid], self.model, device=device()) as dec:
                self.assertEqual(dec.delivery, "cuda_ipc" if device() == "cuda" else "ucx_rma")
        with daemon(ucx=False) as server, kvshade.Client(server.target, timeout=30) as c:
            c.wait_ready(20)
            sid = self.session(c)
            with RemoteDecoder(c, [sid], self.model, device="cpu") as dec:
                self.assertEqual(dec.delivery, "inline")

    def test_without_new_tokens_equals_the_service_attend(self):
        with daemon(ucx=False) as server, kvshade.Client(server.target, timeout=30) as c:
            c.wait_ready(20)
            sid = self.session(c)
            a = c.attach(sid, "service")
            with RemoteDecoder(c, [sid], self.model, device="cpu") as dec:
                for step in self.steps(3, 1):
                    for layer, (q, _, _) in enumerate(step):
                        got = dec.attend(layer, q)
                        want = torch.from_numpy(c.attend(layer, [a.attachment_id], q.numpy()))
                        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    def test_batch_equals_each_session_alone_and_serves_exact_sessions(self):
        with daemon(ucx=False) as server, kvshade.Client(server.target, timeout=30) as c:
            c.wait_ready(20)
            sids = [self.session(c), self.session(c, kvshade.Profile("exact"), n=200)]
            self.assertEqual([c.get_session(s)["profile"] for s in sids], ["shadow", "exact"])
            steps = self.steps(4, 2)
            # CUDA: the batch attends with a mask (the exact session has no slots), each shadow
            # session alone without one (other kernels): equal to bf16 precision; CPU: to fp32.
            dev = device()
            tight, loose = (1e-6, 2e-5) if dev == "cpu" else (2e-2, 2e-2)
            on = lambda t: t.to(dev)  # noqa: E731
            with RemoteDecoder(c, sids, self.model, device=dev) as both:
                batched = [[both.attend(l, on(q), on(k), on(v)).cpu() for l, (q, k, v) in enumerate(step)]
                           for step in steps]
            for b, sid in enumerate(sids):
                with RemoteDecoder(c, [sid], self.model, device=dev) as one:
                    for i, step in enumerate(steps):
                        for l, (q, k, v) in enumerate(step):
                            got = one.attend(l, on(q[b:b + 1]), on(k[b:b + 1]), on(v[b:b + 1])).cpu()
                            torch.testing.assert_close(got[0], batched[i][l][b], rtol=tight, atol=tight)
            # The exact session: attention over all its tokens and the new ones, as a dense cache.
            ref = KvShadeKVCache(c, self.model, kvshade.Profile("exact"), worker_id="reference")
            ref.attach(sids[1])
            for i, step in enumerate(steps):
                for l, (q, k, v) in enumerate(step):
                    torch.testing.assert_close(batched[i][l][1], ref.attend(l, q[1], k[1], v[1]),
                                               rtol=loose, atol=loose)
            ref.close()

    def test_speculation_that_always_corrects_equals_the_reference(self):
        # Every step re-selects (any cosine is below 1.5): the answers of synchronous
        # selection, and each step after the first counts its corrections, in the decoder's
        # stats and in the daemon's kvshade_decode_selects_total{purpose}.
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        with Server("--metrics-listen", "127.0.0.1", "--metrics-port", str(port)) as server, \
                kvshade.Client(server.target, timeout=30) as c:
            c.wait_ready(20)
            sids = [self.session(c), self.session(c)]
            refs = []
            for sid in sids:
                r = KvShadeKVCache(c, self.model, self.shadow, worker_id="reference")
                r.attach(sid)
                refs.append(r)
            steps = self.steps(4, 2)
            with RemoteDecoder(c, sids, self.model, device="cpu", speculate=True, correct_below=1.5) as dec:
                for step in steps:
                    for layer, (q, k, v) in enumerate(step):
                        out = dec.attend(layer, q, k, v)
                        for b, r in enumerate(refs):
                            torch.testing.assert_close(out[b], r.attend(layer, q[b], k[b], v[b]),
                                                       rtol=2e-5, atol=2e-5)
                st = dec.stats()
                self.assertEqual(st["corrections"], 3 * L * 2)
                self.assertEqual(st["speculated"], 0)
            text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10).read().decode()
            counts = {m.group(1): float(m.group(2)) for m in
                      re.finditer(r'^kvshade_decode_selects_total\{purpose="(\w+)"\} (\S+)$', text, re.M)}
            # Per layer and sequence: step 0 synchronous, steps 1-3 corrected, every step one
            # speculative select for the next (the references' selects are synchronous too).
            self.assertEqual(counts, {"synchronous": 1 * L * 2 + 4 * L * 2, "correction": 3 * L * 2,
                                      "speculative": 4 * L * 2})
            for r in refs:
                r.close()

    def test_speculation_that_never_corrects_attends_over_the_previous_selection(self):
        # No correction (cosines are never below -2): layer l of step t attends over the
        # chunks the daemon selected with step t-1's query. The reference is a synchronous
        # decoder driven step by step: select with the previous query, then attend.
        with daemon(ucx=False) as server, kvshade.Client(server.target, timeout=30) as c:
            c.wait_ready(20)
            sids = [self.session(c), self.session(c)]
            steps = self.steps(5, 2)
            with RemoteDecoder(c, sids, self.model, device="cpu", speculate=True, correct_below=-2) as dec, \
                    RemoteDecoder(c, sids, self.model, device="cpu", worker_id="reference") as ref:
                differs = 0
                for t, step in enumerate(steps):
                    for layer, (q, k, v) in enumerate(step):
                        got = dec.attend(layer, q, k, v)
                        ref._select(layer, steps[max(t - 1, 0)][layer][0])  # the selection used
                        ref._append_local(layer, k, v)
                        want = ref._attention(layer, q)
                        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
                        if t > 0:  # and it is not the current query's
                            ref._select(layer, q)
                            differs += not torch.allclose(ref._attention(layer, q), want, rtol=1e-4, atol=1e-4)
                self.assertGreater(differs, 0)
                st = dec.stats()
                self.assertEqual(st["speculated"], 4 * L * 2)
                self.assertEqual(st["corrections"], 0)
                self.assertGreaterEqual(st["exposed_wait_s"], 0.0)

    def test_speculation_corrects_only_the_heads_whose_query_drifted(self):
        # KV head 0's query heads move a little each step (cosine about 0.93 to the last
        # query), KV head 1's are fresh (cosine about 0): with correct_below 0.8 only head 1
        # is re-selected. The reference, a synchronous decoder, selects with head 0's previous
        # query and head 1's current one, then attends: the same output, and at some step
        # not the output of a selection with the current query for every head.
        g = HQ // H
        with daemon(ucx=False) as server, kvshade.Client(server.target, timeout=30) as c:
            c.wait_ready(20)
            sids = [self.session(c), self.session(c)]
            steps = self.steps(5, 2)
            for t in range(1, len(steps)):
                for layer in range(L):
                    q = steps[t][layer][0]
                    prev = steps[t - 1][layer][0]
                    q[:, :g] = (prev[:, :g] + 0.8 * torch.randn_like(prev[:, :g])).bfloat16().float()
            with RemoteDecoder(c, sids, self.model, device="cpu", speculate=True, correct_below=0.8) as dec, \
                    RemoteDecoder(c, sids, self.model, device="cpu", worker_id="reference") as ref:
                differs = 0
                for t, step in enumerate(steps):
                    for layer, (q, k, v) in enumerate(step):
                        got = dec.attend(layer, q, k, v)
                        mixed = q.clone()
                        if t > 0:
                            mixed[:, :g] = steps[t - 1][layer][0][:, :g]
                        ref._select(layer, mixed)
                        ref._append_local(layer, k, v)
                        want = ref._attention(layer, q)
                        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
                        if t > 0:
                            ref._select(layer, q)
                            differs += not torch.allclose(ref._attention(layer, q), want, rtol=1e-4, atol=1e-4)
                self.assertGreater(differs, 0)
                st = dec.stats()
                self.assertEqual(st["corrections"], 4 * L * 2)     # every sequence-layer after step 0
                self.assertEqual(st["corrected_heads"], 4 * L * 2)  # one KV head of each
                self.assertEqual(st["speculated_heads"], 4 * L * 2)
                self.assertEqual(st["speculated"], 0)

    def daemon_rows(self, c, session_id, layer, slots):
        """The rows the daemon's Attend attends for a layer with every chunk open (the guard's
        "exact" fallback): static set, every selectable chunk reconstructed (fetched by
        model-native selects of `slots` chunks per head through an attachment of its own) and
        exact tail; keys, values [h, n, d] float32 and the mask [h, n] of real rows."""
        probe = c.attach(session_id, "rows")
        try:
            st = c.static_set(probe.attachment_id, layer)
            C = probe.chunk_size
            first_tail = int(st.tail_positions[0])
            self.assertEqual(first_tail % C, 0)
            n_chunks = first_tail // C  # chunk j covers tokens [j*C, (j+1)*C): one segment
            chunks = [dict() for _ in range(H)]
            for c0 in range(0, n_chunks, slots):
                ids = list(range(c0, min(c0 + slots, n_chunks)))
                ids += [-1] * (slots - len(ids))
                (d,) = c.select_chunks(layer, [probe.attachment_id], np.array([ids] * H, np.int32))
                for i in range(len(d.head)):
                    chunks[int(d.head[i])][int(d.chunk[i])] = (d.keys[i], d.values[i])
        finally:
            c.detach(probe.attachment_id)
        # Every chunk is the head's: static (an outlier or the sink) or served above.
        for hh in range(H):
            static = {int(p) // C for p in st.positions[hh, :int(st.lengths[hh])]}
            self.assertEqual(static | set(chunks[hh]), set(range(n_chunks)), "head %d" % hh)
            self.assertFalse(static & set(chunks[hh]))
        m = max(len(x) for x in chunks) * C
        ck, cv = np.zeros((H, m, D), np.float32), np.zeros((H, m, D), np.float32)
        cmask = np.zeros((H, m), bool)
        for hh in range(H):
            rows = [chunks[hh][j] for j in sorted(chunks[hh])]
            if rows:
                ck[hh, :len(rows) * C] = np.concatenate([r[0] for r in rows])
                cv[hh, :len(rows) * C] = np.concatenate([r[1] for r in rows])
                cmask[hh, :len(rows) * C] = True
        smask = np.arange(st.k.shape[1])[None, :] < st.lengths[:, None].astype(np.int64)
        keys = np.concatenate([st.k, ck, st.tail_k.transpose(1, 0, 2)], axis=1)
        values = np.concatenate([st.v, cv, st.tail_v.transpose(1, 0, 2)], axis=1)
        mask = np.concatenate([smask, cmask, np.ones((H, st.tail_k.shape[0]), bool)], axis=1)
        return torch.from_numpy(keys), torch.from_numpy(values), torch.from_numpy(mask)

    def test_recall_guard_fallback_attends_through_the_service(self):
        # Session 0 samples every step against the oracle with a floor of 1 and a budget of 2
        # chunks: after a window of 4 samples of a layer the guard opens every chunk of it
        # ("exact"), more than the slots hold, and the select's delta says `fallback`. From
        # then on the decoder attends that layer of session 0 through the daemon's Attend,
        # merged with the tokens decoded here: equal to the same Attend + merge done here,
        # and to the fp32 reference over the daemon's own rows (static set, every chunk
        # reconstructed, tail) and the local tokens. Session 1 (same slot geometry, no
        # guard) keeps the slot path, equal to the torch_hook reference. Synchronous and
        # speculating decoders alike.
        geometry = dict(rank=16, chunk_size=8, sparse_budget=2, outliers=4, local_window=32)
        guarded = kvshade.Profile("shadow", recall_sample_rate=1.0, recall_floor=1.0, recall_action="exact",
                                  **geometry)
        plain = kvshade.Profile("shadow", **geometry)
        with daemon(ucx=False) as server, kvshade.Client(server.target, timeout=30) as c:
            c.wait_ready(20)
            for speculate in (False, True):
                with self.subTest(speculate=speculate):
                    sids = [self.session(c, guarded), self.session(c, plain)]
                    service = c.attach(sids[0], "service")
                    ref = KvShadeKVCache(c, self.model, plain, worker_id="reference")
                    ref.attach(sids[1])
                    rows = {}
                    local_k, local_v = [[] for _ in range(L)], [[] for _ in range(L)]
                    checked = 0
                    with RemoteDecoder(c, sids, self.model, device="cpu", speculate=speculate,
                                       correct_below=1.5) as dec:
                        for step in self.steps(8, 2):
                            for layer, (q, k, v) in enumerate(step):
                                before = dec.stats()["fallbacks"]
                                out = dec.attend(layer, q, k, v)
                                local_k[layer].append(k[0])
                                local_v[layer].append(v[0])
                                torch.testing.assert_close(out[1], ref.attend(layer, q[1], k[1], v[1]),
                                                           rtol=2e-5, atol=2e-5)
                                if dec.stats()["fallbacks"] == before:
                                    continue  # not (yet) under the fallback: the slot path
                                self.assertEqual(dec.stats()["fallbacks"], before + 1)
                                lk = torch.stack(local_k[layer], dim=1)  # [h, n, d]
                                lv = torch.stack(local_v[layer], dim=1)
                                o, lse, _ = c.attend(layer, [service.attachment_id], q[:1], with_lse=True)
                                o_loc, lse_loc = attention(q[0], lk, lv, return_lse=True)
                                want, _ = merge_attention(torch.from_numpy(o[0]), torch.from_numpy(lse[0]),
                                                          o_loc, lse_loc)
                                torch.testing.assert_close(out[0], want, rtol=1e-6, atol=1e-6)
                                if layer not in rows:
                                    rows[layer] = self.daemon_rows(c, sids[0], layer, slots=2)
                                keys, values, mask = rows[layer]
                                full = attention(q[0], [keys, lk], [values, lv], [mask, None])
                                torch.testing.assert_close(out[0], full, rtol=2e-5, atol=2e-5)
                                checked += 1
                        st = dec.stats()
                        self.assertEqual(st["fallbacks"], checked)
                        self.assertGreater(checked, 0)
                        # The guard's figures: session 0 only (session 1 samples nothing),
                        # every chunk open on the layers that fell back, worst recall first.
                        sel = dec.selection()
                        self.assertEqual({r["session_id"] for r in sel}, {sids[0]})
                        self.assertEqual({r["sequence"] for r in sel}, {0})
                        self.assertEqual([r["recall"] for r in sel], sorted(r["recall"] for r in sel))
                        fell = {r["layer"] for r in sel if r["fallback"] == "exact"}
                        self.assertEqual(fell, set(rows))
                        self.assertTrue(all(r["budget"] > 2 for r in sel if r["layer"] in fell))
                        self.assertEqual(sel, sorted(sel, key=lambda r: (r["recall"], r["recent_recall"],
                                                                         r["layer"])))
                    ref.close()
                    c.detach(service.attachment_id)

    def check_join_and_leave(self, c, delivery):
        """Sequences join and leave between steps (slot rows grown past max_batch, reused after
        a leave, an exact session among them); each step's output for each sequence equals a
        decoder over that session alone fed the same inputs since it joined."""
        dev = device()
        tol = 2e-5 if dev == "cpu" else 2e-2
        on = lambda t: t.to(dev)  # noqa: E731
        sids = [self.session(c), self.session(c, n=300), self.session(c, kvshade.Profile("exact"), n=200),
                self.session(c, n=400)]
        alone = {}
        plan = [("start", [0]), ("join", 1), ("join", 2), ("leave", 0), ("join", 3), ("leave", sids[2])]
        with RemoteDecoder(c, [sids[0]], self.model, device=dev, delivery=delivery, local_capacity=2) as dec:
            members = [0]
            alone[0] = RemoteDecoder(c, [sids[0]], self.model, device=dev, delivery=delivery, worker_id="alone")
            for what, arg in plan:
                if what == "join":
                    self.assertEqual(dec.join(sids[arg]), len(members))
                    members.append(arg)
                    alone[arg] = RemoteDecoder(c, [sids[arg]], self.model, device=dev, delivery=delivery,
                                               worker_id="alone")
                elif what == "leave":
                    i = arg if isinstance(arg, int) else members.index(sids.index(arg))
                    dec.leave(arg)
                    gone = members.pop(i)
                    alone.pop(gone).close()
                self.assertEqual(dec.batch, len(members))
                self.assertEqual(dec.session_ids, [sids[m] for m in members])
                for step in self.steps(2, len(members)):
                    for layer, (q, k, v) in enumerate(step):
                        got = dec.attend(layer, on(q), on(k), on(v)).cpu()
                        for i, m in enumerate(members):
                            want = alone[m].attend(layer, on(q[i:i + 1]), on(k[i:i + 1]), on(v[i:i + 1])).cpu()
                            torch.testing.assert_close(got[i], want[0], rtol=tol, atol=tol,
                                                       msg=lambda e: "after %s %s: %s" % (what, arg, e))
                    dec.advance()
            self.assertEqual(dec.delivery, delivery)
            with self.assertRaises(IndexError):
                dec.leave(7)
            with self.assertRaises(ValueError):
                dec.leave("no-such-session")
        for a in alone.values():
            a.close()
        for sid in sids:
            self.assertEqual(c.get_session(sid)["attachments"], 0)  # every attachment ended

    def test_sequences_join_and_leave_inline(self):
        with daemon(ucx=False) as server, kvshade.Client(server.target, timeout=30) as c:
            c.wait_ready(20)
            self.check_join_and_leave(c, "inline")

    def test_sequences_join_and_leave_ucx_rma(self):
        with daemon(ucx=True) as server, \
                kvshade.Client(server.target, timeout=30, use_ucx=True, ucx_transports="tcp,self") as c:
            c.wait_ready(20)
            self.check_join_and_leave(c, "ucx_rma")

    def test_an_empty_decoder_fills_by_joins(self):
        """An empty decoder; an exact session joins and decodes (no slots yet), then a shadow
        one: the slot buffers and the delivery come with it, the exact session keeps its
        tokens decoded so far."""
        with daemon(ucx=False) as server, kvshade.Client(server.target, timeout=30) as c:
            c.wait_ready(20)
            exact, shadow = self.session(c, kvshade.Profile("exact"), n=200), self.session(c)
            with RemoteDecoder(c, [], self.model, device="cpu") as dec, \
                    RemoteDecoder(c, [exact], self.model, device="cpu", worker_id="alone") as one, \
                    RemoteDecoder(c, [shadow], self.model, device="cpu", worker_id="alone") as two:
                self.assertEqual((dec.batch, dec.delivery), (0, "none"))
                self.assertEqual(dec.join(exact), 0)
                self.assertEqual(dec.delivery, "none")
                for step in self.steps(2, 1):
                    for layer, (q, k, v) in enumerate(step):
                        torch.testing.assert_close(dec.attend(layer, q, k, v), one.attend(layer, q, k, v),
                                                   rtol=2e-5, atol=2e-5)
                    dec.advance()
                self.assertEqual(dec.join(shadow), 1)
                self.assertEqual(dec.delivery, "inline")
                for step in self.steps(3, 2):
                    for layer, (q, k, v) in enumerate(step):
                        got = dec.attend(layer, q, k, v)
                        torch.testing.assert_close(got[0:1], one.attend(layer, q[0:1], k[0:1], v[0:1]),
                                                   rtol=2e-5, atol=2e-5)
                        torch.testing.assert_close(got[1:2], two.attend(layer, q[1:2], k[1:2], v[1:2]),
                                                   rtol=2e-5, atol=2e-5)
                    dec.advance()
                dec.leave(exact)
                dec.leave(0)
                self.assertEqual(dec.batch, 0)

    def test_follows_the_decoder_protocol(self):
        with daemon(ucx=False) as server, kvshade.Client(server.target, timeout=30) as c:
            c.wait_ready(20)
            sid = self.session(c)
            with RemoteDecoder(c, [sid], self.model, device="cpu") as dec:
                self.assertIsInstance(dec, Decoder)
                self.assertEqual((dec.batch, dec.layers, dec.kv_heads, dec.query_heads, dec.head_dim),
                                 (1, L, H, HQ, D))
                for step in self.steps(2, 1):
                    for layer, (q, k, v) in enumerate(step):
                        self.assertEqual(tuple(dec.attend(layer, q, k, v).shape), (1, HQ, D))
                    dec.advance()
                st = dec.stats()
                self.assertEqual(st["steps"], 2)
                self.assertEqual(st["fallbacks"], 0)
                self.assertGreater(st["selected"], 0)
                self.assertIn("hits", st)
                self.assertEqual(dec.selection(), [])  # no recall guard on this profile
            self.assertNotIsInstance(KvShadeKVCache(c, self.model, self.shadow), Decoder)
            self.assertNotIsInstance(object(), Decoder)

    def test_bad_calls_are_refused(self):
        with daemon(ucx=False) as server, kvshade.Client(server.target, timeout=30) as c:
            c.wait_ready(20)
            sid = self.session(c)
            with self.assertRaises(kvshade.InvalidArgument):
                RemoteDecoder(c, [sid], self.model, delivery="carrier-pigeon")
            # A join of another slot geometry is refused and changes nothing.
            other = self.session(c, kvshade.Profile("shadow", rank=16, chunk_size=8, sparse_budget=16, outliers=4,
                                                    local_window=32))
            with RemoteDecoder(c, [sid], self.model, device="cpu") as dec:
                with self.assertRaises(kvshade.InvalidArgument):
                    dec.join(other)
                self.assertEqual((dec.batch, dec.session_ids), (1, [sid]))
                self.assertEqual(c.get_session(other)["attachments"], 0)
                dec.attend(0, torch.zeros(1, HQ, D))
            with self.assertRaises(kvshade.NotFound):
                RemoteDecoder(c, [sid, "no-such-session"], self.model, device="cpu")
            self.assertEqual(c.get_session(sid)["attachments"], 0)  # nothing left attached
            with self.assertRaises(kvshade.FailedPrecondition):  # ucx_rma needs a data plane
                RemoteDecoder(c, [sid], self.model, device="cpu", delivery="ucx_rma")
            self.assertEqual(c.get_session(sid)["attachments"], 0)
            with RemoteDecoder(c, [sid], self.model, device="cpu") as dec:
                with self.assertRaises(kvshade.InvalidArgument):
                    dec.attend(0, torch.zeros(1, HQ + 1, D))
                with self.assertRaises(kvshade.InvalidArgument):
                    dec.attend(L, torch.zeros(1, HQ, D))
                with self.assertRaises(kvshade.InvalidArgument):
                    dec.attend(0, torch.zeros(1, HQ, D), torch.zeros(1, H, D))


if __name__ == "__main__":
    unittest.main()
