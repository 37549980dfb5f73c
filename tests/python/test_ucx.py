"""The Python package's UCX options against real kvshade-servers: with the daemon's data
plane on (tcp), a use_ucx client connects, its selects equal a plain gRPC client's bit for
bit and nothing falls back; with it off, the client falls back to gRPC loudly (counted),
and still answers. Also: select_async / attend_async equal their sync calls (over UCX and
gRPC), and "ucx_rma" attachments get their misses written into registered slot buffers,
bit-identical to the inline deltas."""
import contextlib
import tempfile
import unittest

import numpy as np

from kvshade_testutil import Server, seed

import kvshade

L, HQ, H, D, N = 2, 4, 2, 32, 512


@contextlib.contextmanager
def ucx_daemon(transports="tcp,self"):
    """A kvshade-server with its UCX data plane on, over `transports`."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as cfg:
        cfg.write('ucx:\n  enable: true\n  transports: "%s"\n' % transports)
        cfg.flush()
        with Server("-c", cfg.name) as server:
            yield server


@contextlib.contextmanager
def plain_and_ucx_clients(transports="tcp,self"):
    """A daemon with UCX on, and two clients of it: gRPC only, and use_ucx."""
    with ucx_daemon(transports) as server, \
            kvshade.Client(server.target, timeout=30) as plain, \
            kvshade.Client(server.target, timeout=30, use_ucx=True, ucx_transports=transports) as fast:
        plain.wait_ready(20)
        yield plain, fast


class UcxTest(unittest.TestCase):
    def setUp(self):
        self.rng = np.random.default_rng(seed())
        self.model = kvshade.ModelSpec("py-ucx", L, HQ, H, D)
        self.profile = kvshade.Profile("shadow", rank=16, chunk_size=8, sparse_budget=8, outliers=4, local_window=32)

    def session(self, c):
        ids = self.rng.integers(0, 30000, N)
        s = c.create_session(self.model, self.profile, ids)
        with c.ingest(s.session_id) as ing:
            for l in range(L):
                ing.layer(l, self.rng.standard_normal((N, H, D)), self.rng.standard_normal((N, H, D)))
            ing.commit()
        return s.session_id

    def test_select_over_ucx_equals_grpc(self):
        with plain_and_ucx_clients() as (plain, fast):
            sid = self.session(plain)
            self.assertFalse(fast.ucx_connected)  # connects at the first attach
            a_plain = plain.attach(sid, "plain")
            a_fast = fast.attach(sid, "fast")
            self.assertTrue(a_fast.data_plane)
            self.assertEqual(a_fast.delivery, "inline")
            self.assertTrue(fast.ucx_connected)
            self.assertFalse(plain.ucx_connected)
            moved = 0
            for step in range(3):
                for l in range(L):
                    q = self.rng.standard_normal((1, HQ, D)).astype(np.float32)
                    (dp,) = plain.select(l, [a_plain.attachment_id], q)
                    (du,) = fast.select(l, [a_fast.attachment_id], q)
                    for name in ("head", "slot", "chunk", "keys", "values"):
                        np.testing.assert_array_equal(getattr(dp, name), getattr(du, name), err_msg=name)
                    self.assertEqual((dp.hits, dp.selected), (du.hits, du.selected))
                    moved += len(du.head)
            self.assertGreater(moved, 0)
            self.assertEqual(fast.ucx_fallbacks, 0)
            # The daemon's own errors come back as exceptions, not fallbacks.
            with self.assertRaises(kvshade.NotFound):
                fast.select(0, ["no-such-attachment"], np.zeros((1, HQ, D), np.float32))
            self.assertEqual(fast.ucx_fallbacks, 0)
            self.assertTrue(fast.ucx_connected)
            fast.detach(a_fast.attachment_id)
            plain.detach(a_plain.attachment_id)
            plain.close_session(sid)

    def check_async(self, c, sid):
        a, b = c.attach(sid, "sync"), c.attach(sid, "async")
        for step in range(2):
            for l in range(L):
                q = self.rng.standard_normal((1, HQ, D)).astype(np.float32)
                (ds,) = c.select(l, [a.attachment_id], q)
                fut = c.select_async(l, [b.attachment_id], q)
                (da,) = fut.result()
                self.assertTrue(fut.done())
                self.assertEqual(da.attachment_id, b.attachment_id)
                for name in ("head", "slot", "chunk", "keys", "values"):
                    np.testing.assert_array_equal(getattr(ds, name), getattr(da, name), err_msg=name)
                futs = [c.attend_async(l, [a.attachment_id], q) for _ in range(3)]  # several in flight
                want = c.attend(l, [a.attachment_id], q)
                for f in futs:
                    np.testing.assert_array_equal(f.result(), want)
        with self.assertRaises(kvshade.NotFound):
            c.select_async(0, ["no-such-attachment"], np.zeros((1, HQ, D), np.float32)).result()
        c.detach(a.attachment_id)
        c.detach(b.attachment_id)

    def test_async_calls_equal_sync_over_ucx_and_grpc(self):
        with plain_and_ucx_clients() as (plain, fast):
            sid = self.session(plain)
            self.check_async(plain, sid)
            self.check_async(fast, sid)
            self.assertTrue(fast.ucx_connected)
            self.assertEqual(fast.ucx_fallbacks, 0)

    def test_rma_slot_buffers_receive_the_inline_bytes(self):
        with plain_and_ucx_clients() as (plain, fast):
            sid = self.session(plain)
            inline = plain.attach(sid, "inline")
            rma = fast.attach(sid, "rma", delivery="ucx_rma")
            self.assertEqual(rma.delivery, "ucx_rma")
            S, Cc = rma.slots_per_head, rma.chunk_size
            shape = (L, H, S, Cc, D)
            self.assertEqual(rma.slot_buffer_bytes, int(np.prod(shape)) * 2)
            kbuf, vbuf = np.zeros(shape, np.uint16), np.zeros(shape, np.uint16)
            with self.assertRaises(kvshade.InvalidArgument):
                fast.register_slot_buffers(rma.attachment_id, kbuf, vbuf[:1])
            fast.register_slot_buffers(rma.attachment_id, kbuf, vbuf)
            delivered = 0
            for step in range(3):
                for l in range(L):
                    q = self.rng.standard_normal((1, HQ, D)).astype(np.float32)
                    (di,) = plain.select(l, [inline.attachment_id], q)
                    (dr,) = fast.select(l, [rma.attachment_id], q)
                    for name in ("head", "slot", "chunk"):
                        np.testing.assert_array_equal(getattr(di, name), getattr(dr, name), err_msg=name)
                    if len(dr.head):
                        self.assertTrue(dr.delivered)
                        self.assertIsNone(dr.keys)
                    for m, (h, s) in enumerate(zip(dr.head, dr.slot)):
                        np.testing.assert_array_equal(kvshade.bf16_bits_to_f32(kbuf[l, h, s]).reshape(Cc, D),
                                                      di.keys[m])
                        np.testing.assert_array_equal(kvshade.bf16_bits_to_f32(vbuf[l, h, s]).reshape(Cc, D),
                                                      di.values[m])
                        delivered += 1
            self.assertGreater(delivered, 0)
            self.assertEqual(fast.ucx_fallbacks, 0)
            fast.detach(rma.attachment_id)
            plain.detach(inline.attachment_id)
            # Without a data plane there is nothing to register with.
            other = plain.attach(sid, "no-ucx", delivery="ucx_rma")
            with self.assertRaises(kvshade.FailedPrecondition):
                plain.register_slot_buffers(other.attachment_id, kbuf, vbuf)
            plain.detach(other.attachment_id)
            with self.assertRaises(kvshade.InvalidArgument):
                plain.attach(sid, "bad", delivery="carrier-pigeon")

    def test_ingest_and_append_over_ucx(self):
        with ucx_daemon() as server, \
                kvshade.Client(server.target, timeout=30, use_ucx=True, ucx_transports="tcp,self",
                               ucx_ingest_window=2) as fast:
            fast.wait_ready(20)
            sid = self.session(fast)  # ingest before any attach: connects on its own
            self.assertTrue(fast.ucx_connected)
            info = fast.get_session(sid)
            self.assertEqual((info["state"], info["tokens"]), ("ready", N))
            att = fast.attach(sid, "writer", writer=True)
            k = self.rng.standard_normal((L, 2, H, D)).astype(np.float32)
            self.assertEqual(fast.append(sid, [5, 6], k, -k, attachment_id=att.attachment_id), N + 2)
            (d,) = fast.select(0, [att.attachment_id], self.rng.standard_normal((1, HQ, D)))
            self.assertGreater(len(d.head), 0)
            self.assertEqual(fast.ucx_fallbacks, 0)
            fast.detach(att.attachment_id)

    def test_ingest_over_ucx_and_grpc_give_identical_sessions(self):
        # The same prompt K/V ingested by a gRPC-only client and by a UCX client (two parts
        # in flight) into separate prefix caches: the static sets and Attend over the two
        # sessions are equal bit for bit.
        ids = self.rng.integers(0, 30000, N).tolist()
        ks = [self.rng.standard_normal((N, H, D)).astype(np.float32) for _ in range(L)]
        vs = [self.rng.standard_normal((N, H, D)).astype(np.float32) for _ in range(L)]
        with ucx_daemon() as server, \
                kvshade.Client(server.target, timeout=30) as plain, \
                kvshade.Client(server.target, timeout=30, use_ucx=True, ucx_transports="tcp,self",
                               ucx_ingest_window=2) as fast:
            plain.wait_ready(20)
            atts = []
            for name, c in (("grpc", plain), ("ucx", fast)):
                model = kvshade.ModelSpec("py-ucx-ingest-" + name, L, HQ, H, D)
                created = c.create_session(model, self.profile, ids)
                with c.ingest(created.session_id) as ing:
                    for l in range(L):
                        ing.layer(l, ks[l], vs[l])
                    ing.commit()
                atts.append(plain.attach(created.session_id, "ingest-" + name).attachment_id)
            self.assertTrue(fast.ucx_connected)
            self.assertEqual(fast.ucx_fallbacks, 0)
            for l in range(L):
                a, b = plain.static_set(atts[0], l), plain.static_set(atts[1], l)
                np.testing.assert_array_equal(a.k, b.k)
                np.testing.assert_array_equal(a.v, b.v)
                np.testing.assert_array_equal(a.tail_k, b.tail_k)
                np.testing.assert_array_equal(a.tail_v, b.tail_v)
                q = self.rng.standard_normal((1, HQ, D)).astype(np.float32)
                out = [plain.attend(l, [att], q) for att in atts]
                np.testing.assert_array_equal(out[0], out[1])
                self.assertGreater(float(np.abs(out[0]).max()), 0.0)
            for att in atts:
                plain.detach(att)

    def test_daemon_without_ucx_falls_back_loudly(self):
        with Server() as server, \
                kvshade.Client(server.target, timeout=30, use_ucx=True) as c:
            c.wait_ready(20)
            sid = self.session(c)
            att = c.attach(sid, "w")
            self.assertFalse(att.data_plane)
            self.assertFalse(c.ucx_connected)
            self.assertEqual(c.ucx_fallbacks, 1)
            (d,) = c.select(0, [att.attachment_id], self.rng.standard_normal((1, HQ, D)))
            self.assertGreater(len(d.head), 0)
            self.assertEqual(c.ucx_fallbacks, 1)  # counted once, at connect
            c.detach(att.attachment_id)

    def test_plain_client_has_no_ucx(self):
        with Server() as server, kvshade.Client(server.target) as c:
            c.wait_ready(20)
            self.assertFalse(c.ucx_connected)
            self.assertEqual(c.ucx_fallbacks, 0)


if __name__ == "__main__":
    unittest.main()
