"""kvshade.Client against a kvshade-server with two devices (backend cpu:0,cpu:1;
docs/OPERATIONS.md "Devices"): the device a session is created on, reported by
create_session and get_session; an unknown device refused; attach checking the worker's
device; lookup_prefix per device; per-device statistics (Client.device_stats, through
kvshade_get_device_stats). The C ABI's device fields and calls carry it through.

Also the device a worker's sessions go to (kvshade.routing.choose_device / session_device,
what the transformers adapters and torch_hook use): the rule over made-up device lists
(GPU workers with a fake PCI bus id lookup), and against the daemon (its CPU devices are no
GPU; names pass as they are), and torch_hook placing its session where `device=` says."""
import unittest

import numpy as np

from kvshade_testutil import Server, seed

import kvshade
from kvshade.routing import choose_device, session_device

try:
    import torch
    from kvshade.integrations.torch_hook import KvShadeKVCache
except ImportError:  # torch is optional for the package
    torch = None

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

    def test_device_stats_are_per_device_and_sum_to_stats(self):
        before = self.c.device_stats()
        self.assertEqual([d["device"] for d in before], ["cpu:0", "cpu:1"])
        self.assertEqual([d["pci_bus_id"] for d in before], ["", ""])  # CPU devices
        s, tokens = self.session("cpu:1")
        a = self.c.attach(s.session_id, "w", device="cpu:1")
        after = self.c.device_stats()
        self.assertEqual(after[1]["sessions"], before[1]["sessions"] + 1)
        self.assertEqual(after[1]["attachments"], before[1]["attachments"] + 1)
        self.assertEqual(after[0]["sessions"], before[0]["sessions"])
        self.assertEqual(after[0]["attachments"], before[0]["attachments"])
        self.assertGreater(after[1]["segments"], before[1]["segments"])
        self.assertGreater(after[1]["host_bytes_used"] + after[1]["device_bytes_used"],
                           before[1]["host_bytes_used"] + before[1]["device_bytes_used"])
        self.assertEqual(after[1]["prefix_lookups"], before[1]["prefix_lookups"] + 1)  # its create
        self.assertEqual(after[0]["prefix_lookups"], before[0]["prefix_lookups"])
        self.c.lookup_prefix(self.model, kvshade.Profile("exact"), tokens, device="cpu:1")
        self.assertEqual(self.c.device_stats()[1]["prefix_hits"], after[1]["prefix_hits"] + 1)
        # The totals are the devices' sums; each device has the daemon's device budget and
        # half of its host budget.
        per, total = self.c.device_stats(), self.c.stats()
        for key in ("sessions", "attachments", "segments", "device_bytes_used", "host_bytes_used",
                    "spilled_bytes", "prefix_lookups", "prefix_hits", "chunks_selected", "chunk_hits"):
            self.assertEqual(sum(d[key] for d in per), total[key], key)
        for d in per:
            self.assertEqual(d["device_bytes_budget"], total["device_bytes_budget"])
            self.assertLessEqual(d["device_bytes_used"], d["device_bytes_budget"])
        self.assertEqual(per[0]["host_bytes_budget"], per[1]["host_bytes_budget"])
        self.assertLessEqual(sum(d["host_bytes_budget"] for d in per), total["host_bytes_budget"])
        self.c.detach(a.attachment_id)
        self.c.close_session(s.session_id)

    def test_a_gpu_worker_is_given_no_device_of_a_cpu_daemon(self):
        # The daemon's devices are CPU devices: no GPU of the worker is one of them, so its
        # sessions go to the first device, as a call without a device (no error).
        calls = []
        bus = lambda i: calls.append(i) or "0000:3b:00.0"  # noqa: E731
        self.assertEqual(session_device(self.c, None, "cuda:0", pci_bus_id_of=bus), "")
        self.assertEqual(session_device(self.c, 0, "cpu", pci_bus_id_of=bus), "")
        self.assertEqual(calls, [])  # no GPU to find among them: no bus id asked
        # Names go to the daemon as they are (it says which it serves); no lookup for a CPU model.
        self.assertEqual(session_device(self.c, "cpu:1", "cuda:0"), "cpu:1")
        self.assertEqual(session_device(self.c, "", "cuda:0"), "")
        self.assertEqual(session_device(None, None, "cpu"), "")

    @unittest.skipIf(torch is None, "torch is not importable")
    def test_torch_hook_places_its_session_where_device_says(self):
        n = 256
        keys = [torch.randn(n, H, D) for _ in range(L)]
        tokens = self.rng.integers(0, 30000, n)
        hook = KvShadeKVCache(self.c, self.model, kvshade.Profile("exact"), device="cpu:1")
        created = hook.prefill(tokens, keys, keys)
        self.assertEqual(created.device, "cpu:1")
        self.assertEqual(self.c.get_session(hook.session_id)["device"], "cpu:1")
        self.assertEqual(self.c.get_session(hook.session_id)["attachments"], 1)
        hook.close(close_session=True)
        # Its attach names the device: the daemon refuses another device's session to it.
        other, _ = self.session("cpu:0")
        with self.assertRaises(kvshade.FailedPrecondition) as e:
            hook.attach(other.session_id)
        self.assertIn("the worker is on device cpu:1", str(e.exception))
        self.c.close_session(other.session_id)
        # Default: the keys are on the CPU, so the daemon's first device.
        dflt = KvShadeKVCache(self.c, self.model, kvshade.Profile("exact"))
        self.assertEqual(dflt.prefill(tokens, keys, keys).device, "cpu:0")
        self.assertEqual(dflt.device, "")
        dflt.close(close_session=True)
        with self.assertRaises(kvshade.InvalidArgument):
            KvShadeKVCache(self.c, self.model, kvshade.Profile("exact"), device="cpu:9").prefill(tokens, keys, keys)


GPUS = [{"device": "cuda:0", "pci_bus_id": "0000:3b:00.0"}, {"device": "cuda:1", "pci_bus_id": "0000:5E:00.0"}]
BUS = {0: "00000000:5e:00.0", 1: "0000:3B:00.0", 2: "0000:86:00.0"}  # this process's ordinals


class ChooseDeviceTest(unittest.TestCase):
    """The rule itself, over made-up daemons: no daemon, no GPU."""

    def choose(self, devices, worker, **kw):
        return choose_device(devices, worker, pci_bus_id_of=BUS.__getitem__, **kw)

    def test_the_workers_gpu_is_found_by_pci_bus_id(self):
        # Ordinals differ between the processes (CUDA_VISIBLE_DEVICES): the bus id decides,
        # any case and domain width.
        self.assertEqual(self.choose(GPUS, "cuda:0"), "cuda:1")
        self.assertEqual(self.choose(GPUS, "cuda:1"), "cuda:0")
        self.assertEqual(self.choose(GPUS, 1), "cuda:0")
        self.assertEqual(self.choose(GPUS, types_device("cuda", 0)), "cuda:1")
        self.assertEqual(self.choose(GPUS, "cuda:0", same_node=False), "cuda:1")

    def test_a_gpu_the_daemon_does_not_serve_is_an_error_on_its_node(self):
        with self.assertRaises(kvshade.InvalidArgument) as e:
            self.choose(GPUS, "cuda:2")
        msg = str(e.exception)
        for part in ("cuda:2", "0000:86:00.0", "cuda:0 (0000:3b:00.0)", "cuda:1 (0000:5E:00.0)", "device="):
            self.assertIn(part, msg)
        # A worker on another node (the RPC path): the daemon's first device.
        self.assertEqual(self.choose(GPUS, "cuda:2", same_node=False), "")

    def test_no_device_where_there_is_nothing_to_choose(self):
        one = GPUS[:1]
        for devices, worker in ((GPUS, "cpu"), (GPUS, None), (GPUS, types_device("cpu", None)),
                                (one, "cuda:2"), (one, "cuda:1"), ([], "cuda:0"),
                                ([{"device": "cpu:0", "pci_bus_id": ""}, {"device": "cpu:1", "pci_bus_id": ""}],
                                 "cuda:0")):
            with self.subTest(devices=devices, worker=worker):
                self.assertEqual(self.choose(devices, worker), "")

    def test_bad_worker_devices_are_refused(self):
        for bad in ("cuda:x", -1, True, 1.5):
            with self.subTest(worker=bad):
                with self.assertRaises(kvshade.InvalidArgument):
                    self.choose(GPUS, bad)
        with self.assertRaises(kvshade.InvalidArgument):  # a bus id that is no PCI address
            choose_device(GPUS, "cuda:0", pci_bus_id_of=lambda i: "GPU-0")


def types_device(kind, index):
    """A stand-in for torch.device (type, index), so the rule is checked without torch."""
    return type("FakeDevice", (), {"type": kind, "index": index})()


if __name__ == "__main__":
    unittest.main()
