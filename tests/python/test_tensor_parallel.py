"""Tensor-parallel sessions (docs/DESIGN.md "Tensor-parallel sessions") through the C ABI
and kvshade.Client, against a kvshade-server with two CPU devices (cpu:0,cpu:1): two ranks,
each creating or joining the logical session with its half of the KV heads on its own
device, ingesting and appending its heads; per rank, remote select and attend and same-node
decode (kvshade.decoders.local.LocalDecoder) equal a whole-model session on the same heads; the
logical session's info and shards; fork and close of the logical session; refusals that
create nothing."""
import unittest

import numpy as np
import torch

from kvshade_testutil import Server, seed

import kvshade
from kvshade.decoders.local import LocalDecoder

L, HQ, H, D, N = 2, 8, 4, 32, 512
G = HQ // H
RANKS = ((0, 2, "cpu:0"), (2, 4, "cpu:1"))


class TensorParallelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        rng = np.random.default_rng(seed())
        cls.server = Server(backend="cpu:0,cpu:1")
        cls.c = kvshade.Client(cls.server.target, timeout=30)
        cls.c.wait_ready(20)
        cls.model = kvshade.ModelSpec("py-tp", num_layers=L, num_query_heads=HQ, num_kv_heads=H, head_dim=D)
        cls.profile = kvshade.Profile("shadow", rank=32, sparse_budget=8, outliers=4, chunk_size=8)
        cls.tokens = rng.integers(0, 30000, N + 4)
        cls.k, cls.v = [], []
        for _ in range(L):
            lat = rng.standard_normal((N + 4, 8)).astype(np.float32)
            cls.k.append((lat @ rng.standard_normal((8, H * D)).astype(np.float32)).reshape(N + 4, H, D))
            cls.v.append(rng.standard_normal((N + 4, H, D)).astype(np.float32))
        cls.rng = rng

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        rc = cls.server.stop()
        assert rc == 0, "server exit code %d" % rc

    def ingest(self, session_id, b, e):
        with self.c.ingest(session_id) as ing:
            for layer in range(L):
                ing.layer(layer, self.k[layer][:N, b:e], self.v[layer][:N, b:e])
            ing.commit()

    def append(self, session_id, b, e):
        self.c.append(session_id, self.tokens[N:], np.stack([self.k[layer][N:, b:e] for layer in range(L)]),
                      np.stack([self.v[layer][N:, b:e] for layer in range(L)]))

    def open_tp(self, durable=False):
        logical, shards = "", []
        for rank, (b, e, dev) in enumerate(RANKS):
            tp = kvshade.TensorParallel(2, rank, b, e, session_id=logical)
            created = self.c.create_session(self.model, self.profile, self.tokens[:N], durable=durable,
                                            device=dev, tensor_parallel=tp)
            self.assertEqual((created.tp_ranks, created.tp_rank, created.tp_ranks_joined), (2, rank, rank + 1))
            self.assertEqual(created.device, dev)
            logical = created.tp_session_id
            shards.append(created.session_id)
            self.ingest(created.session_id, b, e)
        return logical, shards

    def rel(self, ref, out):
        return float(np.abs(ref - out).max() / max(np.abs(ref).max(), 1e-30))

    def test_ranks_decode_as_the_whole_model(self):
        whole = self.c.create_session(self.model, self.profile, self.tokens[:N])
        self.ingest(whole.session_id, 0, H)
        logical, shards = self.open_tp()
        info = self.c.get_session(logical)
        self.assertEqual(info["state"], "ready")
        self.assertEqual(info["tokens"], N)
        self.assertEqual(info["tensor_parallel"]["session_id"], logical)
        self.assertEqual(info["tensor_parallel"]["ranks_joined"], 2)
        got = self.c.tensor_parallel_shards(logical)
        self.assertEqual([(s["rank"], s["kv_head_begin"], s["kv_head_end"], s["device"], s["session_id"])
                          for s in got], [(0, 0, 2, "cpu:0", shards[0]), (1, 2, 4, "cpu:1", shards[1])])
        si = self.c.get_session(shards[1])
        self.assertEqual(si["device"], "cpu:1")
        self.assertEqual((si["tensor_parallel"]["rank"], si["tensor_parallel"]["kv_head_begin"]), (1, 2))
        with self.assertRaises(kvshade.InvalidArgument):
            self.c.tensor_parallel_shards(whole.session_id)
        with self.assertRaises(kvshade.FailedPrecondition):
            self.c.attach(logical, "w")

        wa = self.c.attach(whole.session_id, "w").attachment_id
        sa = [self.c.attach(s, "w").attachment_id for s in shards]
        g = torch.Generator().manual_seed(7)
        decoders = [LocalDecoder(self.c, [a], backend="cpu") for a in sa]
        try:
            for step in range(2):
                for layer in range(L):
                    q = torch.randn(1, HQ, D, generator=g).to(torch.bfloat16)
                    qn = q.float().numpy()
                    ref_sel = self.c.select(layer, [wa], qn)[0]
                    self.assertGreater(ref_sel.selected, 0)
                    if step == 0:
                        self.assertGreater(ref_sel.chunk.size, 0)  # misses to compare
                    ref = self.c.attend(layer, [wa], qn)[0]
                    for rank, (b, e, _) in enumerate(RANKS):
                        qr = q[:, b * G:e * G].contiguous()
                        sel = self.c.select(layer, [sa[rank]], qr.float().numpy())[0]
                        mine = (ref_sel.head >= b) & (ref_sel.head < e)
                        self.assertEqual(sel.head.tolist(), (ref_sel.head[mine] - b).tolist())
                        self.assertEqual(sel.chunk.tolist(), ref_sel.chunk[mine].tolist())
                        self.assertEqual(sel.position.tolist(), ref_sel.position[mine].tolist())
                        np.testing.assert_array_equal(sel.values, ref_sel.values[mine])
                        out = self.c.attend(layer, [sa[rank]], qr.float().numpy())[0]
                        self.assertLess(self.rel(ref[b * G:e * G], out), 0.02, f"layer {layer} rank {rank}")
                        local = decoders[rank].attend(layer, qr).numpy()[0]
                        self.assertEqual(decoders[rank].kv_heads, e - b)
                        self.assertLess(self.rel(out, local), 1e-5, f"local, layer {layer} rank {rank}")
        finally:
            for d in decoders:
                d.close()
        # Appends: the logical session counts the tokens every rank has.
        self.append(shards[0], 0, 2)
        self.assertEqual(self.c.get_session(logical)["tokens"], N)
        self.append(shards[1], 2, 4)
        self.assertEqual(self.c.get_session(logical)["tokens"], N + 4)
        # Fork every rank at the end, then close both logical sessions.
        child, shared = self.c.fork_session(logical, N + 4)
        self.assertEqual(shared, N + 4)
        kids = self.c.tensor_parallel_shards(child)
        self.assertEqual([k["device"] for k in kids], ["cpu:0", "cpu:1"])
        self.assertEqual(self.c.get_session(child)["tokens"], N + 4)
        with self.assertRaises(kvshade.FailedPrecondition):
            self.c.close_session(shards[0])
        for s in (logical, child, whole.session_id):
            self.c.close_session(s)
        for s in shards + [k["session_id"] for k in kids]:
            with self.assertRaises(kvshade.NotFound):
                self.c.get_session(s)

    def test_bad_ranges_are_refused_and_create_nothing(self):
        before = self.c.stats()["sessions"]
        tp = kvshade.TensorParallel(2, 0, 0, 2)
        created = self.c.create_session(self.model, self.profile, self.tokens[:N], device="cpu:0",
                                        tensor_parallel=tp)
        logical = created.tp_session_id
        bad = [
            kvshade.TensorParallel(2, 1, 1, 4, session_id=logical),    # overlaps rank 0
            kvshade.TensorParallel(2, 1, 3, 4, session_id=logical),    # leaves head 2 uncovered
            kvshade.TensorParallel(2, 1, 2, 4, session_id=logical, query_head_begin=5, query_head_end=8),
            kvshade.TensorParallel(2, 0, 0, 2, session_id=logical),    # rank 0 again
            kvshade.TensorParallel(3, 1, 2, 3, session_id=logical),    # other rank count
            kvshade.TensorParallel(2, 1, 2, 5),                         # past the heads
        ]
        for t in bad:
            with self.assertRaises((kvshade.InvalidArgument, kvshade.FailedPrecondition)):
                self.c.create_session(self.model, self.profile, self.tokens[:N], device="cpu:1", tensor_parallel=t)
        with self.assertRaises(kvshade.InvalidArgument) as e:
            self.c.create_session(self.model, self.profile, self.tokens[1:N + 1], device="cpu:1",
                                  tensor_parallel=kvshade.TensorParallel(2, 1, 2, 4, session_id=logical))
        self.assertIn("token_ids differs", str(e.exception))
        with self.assertRaises(kvshade.NotFound):
            self.c.create_session(self.model, self.profile, self.tokens[:N], device="cpu:1",
                                  tensor_parallel=kvshade.TensorParallel(2, 1, 2, 4, session_id="0" * 32))
        self.assertEqual(self.c.stats()["sessions"], before + 1)
        info = self.c.get_session(logical)
        self.assertEqual((info["state"], info["tensor_parallel"]["ranks_joined"]), ("joining", 1))
        self.c.close_session(logical)
        self.assertEqual(self.c.stats()["sessions"], before)


if __name__ == "__main__":
    unittest.main()
