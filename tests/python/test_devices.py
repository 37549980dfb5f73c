"""kvshade.Client against a kvshade-server with two devices (backend cpu:0,cpu:1;
docs/OPERATIONS.md "Devices"): the device a session is created on, reported by
create_session and get_session; an unknown device refused; attach checking the worker's
device; lookup_prefix per device. The C ABI's device fields and calls carry it through."""
import unittest

import numpy as np

from kvshade_testutil import Server, seed

import kvshade

L, HQ, H, D = 2, 4, 2, 16


class DevicesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.rng = np.random.default_rng(seed())
        cls.server = Server(backend="cpu:0,cpu:1")
        cls.c = kvshade.Client(cls.server.target, timeout=30)
        cls.c.wait_ready(20)
        cls.model = kvshade.ModelSpec("py-devices", num_layers=L, num_query_heads=HQ, num_kv_heads=H,
                                      head_dim=D)

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        rc = cls.server.stop()
        assert rc == 0, "server exit code %d" % rc

    def session(self, device, tokens=None):
        tokens = self.rng.integers(0, 30000, 256) if tokens is None else tokens
        created = self.c.create_session(self.model, kvshade.Profile("exact"), tokens, device=device)
        with self.c.ingest(created.session_id) as ing:
            for layer in range(L):
                k = self.rng.standard_normal((tokens.size, H, D)).astype(np.float32)
                ing.layer(layer, k, k)
            ing.commit()
        return created, tokens

    def test_sessions_are_placed_on_the_device_named(self):
        on1, tokens = self.session("cpu:1")
        self.assertEqual(on1.device, "cpu:1")
        self.assertEqual(self.c.get_session(on1.session_id)["device"], "cpu:1")
        dflt, _ = self.session(None)
        self.assertEqual(dflt.device, "cpu:0")
        self.assertEqual(self.c.get_session(dflt.session_id)["device"], "cpu:0")
        # Prefixes are cached per device: the prompt is reusable on cpu:1, not on cpu:0.
        self.assertEqual(self.c.lookup_prefix(self.model, kvshade.Profile("exact"), tokens, device="cpu:1")[0],
                         tokens.size)
        self.assertEqual(self.c.lookup_prefix(self.model, kvshade.Profile("exact"), tokens, device="cpu:0")[0], 0)
        for s in (on1, dflt):
            self.c.close_session(s.session_id)

    def test_an_unknown_device_is_refused(self):
        with self.assertRaises(kvshade.InvalidArgument) as e:
            self.c.create_session(self.model, kvshade.Profile("exact"), np.arange(256), device="cpu:5")
        self.assertIn("is not one of this daemon's devices (cpu:0, cpu:1", str(e.exception))

    def test_attach_checks_the_workers_device(self):
        s, _ = self.session("cpu:1")
        with self.assertRaises(kvshade.FailedPrecondition) as e:
            self.c.attach(s.session_id, "w", device="cpu:0")
        self.assertIn("is on device cpu:1, and the worker is on device cpu:0", str(e.exception))
        a = self.c.attach(s.session_id, "w", device="cpu:1")
        self.assertTrue(a.attachment_id)
        self.assertTrue(self.c.attach(s.session_id, "w2").attachment_id)  # unchecked
        self.assertEqual(self.c.get_session(s.session_id)["attachments"], 2)
        self.c.close_session(s.session_id)


if __name__ == "__main__":
    unittest.main()
