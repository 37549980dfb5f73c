"""kvshade.routing (Python over the C ABI) against the C++ Router's own placement: the prefix
keys, weights and ranks that route_vectors (a C++ program over client::Router) prints for 64
fixed prompts and endpoint lists must be what Python computes; plus the properties callers
rely on (only the first route_prefix_tokens tokens count, removing an endpoint moves only its
keys) and the refusals. Then the per-GPU daemon lookup (gpu_daemon_target, node_gpu_index)
over a made-up sysfs tree."""
import json
import os
import subprocess
import tempfile
import unittest

import numpy as np

import kvshade_testutil  # noqa: F401  (puts client/python on sys.path)

import kvshade
from kvshade import routing


def cpp_vectors():
    exe = os.environ.get("KVSHADE_ROUTE_VECTORS")
    if not exe:
        raise unittest.SkipTest("KVSHADE_ROUTE_VECTORS (the route_vectors program) is not set")
    out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines()]


class RoutingTest(unittest.TestCase):
    def test_matches_the_cpp_router(self):
        vectors = cpp_vectors()
        self.assertEqual(len(vectors), 64)
        for v in vectors:
            with self.subTest(model=v["model"], prefix=v["prefix"], n=len(v["tokens"]), names=len(v["names"])):
                key = routing.prefix_key(v["model"], v["tokens"], v["prefix"])
                self.assertEqual(key, v["key"])
                self.assertEqual([routing.rendezvous_weight(n, key) for n in v["names"]], v["weights"])
                self.assertEqual(routing.rendezvous_rank(v["names"], key), v["rank"])
                p = kvshade.Placement(v["names"], v["prefix"])
                self.assertEqual(p.rank(v["model"], v["tokens"]), [v["names"][i] for i in v["rank"]])
                self.assertEqual(p.owner(v["model"], v["tokens"]), v["names"][v["rank"][0]])
        # The set exercises real choices: more than one owner per multi-endpoint list.
        owners = {tuple(v["names"]): set() for v in vectors}
        for v in vectors:
            owners[tuple(v["names"])].add(v["rank"][0])
        self.assertTrue(all(len(o) > 1 for names, o in owners.items() if len(names) > 2), owners)

    def test_only_the_routed_prefix_counts(self):
        rng = np.random.default_rng(7)
        ids = rng.integers(0, 32000, 1000)
        k = routing.prefix_key("m", ids, 256)
        self.assertEqual(routing.prefix_key("m", ids[:256], 256), k)
        self.assertEqual(routing.prefix_key("m", list(ids[:300]), 256), k)
        changed = ids.copy()
        changed[255] += 1
        self.assertNotEqual(routing.prefix_key("m", changed, 256), k)
        changed = ids.copy()
        changed[256] += 1
        self.assertEqual(routing.prefix_key("m", changed, 256), k)
        self.assertNotEqual(routing.prefix_key("m2", ids, 256), k)
        self.assertEqual(routing.prefix_key("m", ids), k)  # 256 is the default

    def test_removing_an_endpoint_moves_only_its_keys(self):
        names = ["kv-%d" % i for i in range(5)]
        rng = np.random.default_rng(11)
        moved = 0
        for _ in range(200):
            key = routing.prefix_key("m", rng.integers(0, 32000, 64))
            owner = names[routing.rendezvous_rank(names, key)[0]]
            rest = [n for n in names if n != "kv-2"]
            owner2 = rest[routing.rendezvous_rank(rest, key)[0]]
            if owner != "kv-2":
                self.assertEqual(owner2, owner)
            else:
                moved += 1
                self.assertEqual(owner2, names[routing.rendezvous_rank(names, key)[1]])
        self.assertGreater(moved, 0)

    def test_refusals(self):
        with self.assertRaises(kvshade.InvalidArgument):
            routing.rendezvous_rank(["a", "b", "a"], 1)
        with self.assertRaises(kvshade.InvalidArgument):
            kvshade.Placement([])
        with self.assertRaises(kvshade.InvalidArgument):
            kvshade.Placement(["a", "a"])
        with self.assertRaises(kvshade.InvalidArgument):
            routing.prefix_key("m", [1, 2], 0)
        self.assertEqual(routing.rendezvous_rank([], 5), [])


def fake_sysfs(root, devices):
    """/sys/bus/pci/devices under root: (address, vendor, class, driver or None) each."""
    os.makedirs(os.path.join(root, "drivers"))
    for address, vendor, klass, driver in devices:
        d = os.path.join(root, "devices", address)
        os.makedirs(d)
        open(os.path.join(d, "vendor"), "w").write(vendor + "\n")
        open(os.path.join(d, "class"), "w").write(klass + "\n")
        if driver:
            os.makedirs(os.path.join(root, "drivers", driver), exist_ok=True)
            os.symlink(os.path.join("..", "..", "drivers", driver), os.path.join(d, "driver"))
    return os.path.join(root, "devices")


class PerGpuDaemonTest(unittest.TestCase):
    def test_target_is_the_base_port_plus_the_gpu(self):
        self.assertEqual(routing.gpu_daemon_target("kvshade.kvshade.svc:50551", 0), "kvshade.kvshade.svc:50551")
        self.assertEqual(routing.gpu_daemon_target("kvshade.kvshade.svc:50551", 7), "kvshade.kvshade.svc:50558")
        self.assertEqual(routing.gpu_daemon_target("[::1]:50551", 3), "[::1]:50554")
        self.assertEqual(routing.gpu_daemon_target("dns:///kv:50551", 1), "dns:///kv:50552")
        for bad in ("kvshade", "unix:/run/kvshade.sock", ":50551", "kv:port"):
            with self.assertRaises(kvshade.InvalidArgument, msg=bad):
                routing.gpu_daemon_target(bad, 1)
        with self.assertRaises(kvshade.InvalidArgument):
            routing.gpu_daemon_target("kv:65535", 1)
        with self.assertRaises(kvshade.InvalidArgument):
            routing.gpu_daemon_target("kv:50551", -1)

    def test_node_gpus_in_pci_bus_order(self):
        with tempfile.TemporaryDirectory() as tmp:
            sysfs = fake_sysfs(tmp, [
                ("0000:b7:00.0", "0x10de", "0x030200", "nvidia"),     # GPU 3
                ("0000:18:00.0", "0x10de", "0x030200", "nvidia"),     # GPU 0
                ("0000:2a:00.0", "0x10de", "0x030000", "nvidia"),     # GPU 1 (VGA class)
                ("0000:9a:00.0", "0x10de", "0x030200", "nvidia"),     # GPU 2
                ("0000:05:00.0", "0x10de", "0x068000", "nvidia"),     # an NVSwitch: not a GPU
                ("0000:3b:00.0", "0x10de", "0x030200", "vfio-pci"),   # passed to a VM
                ("0000:3c:00.0", "0x10de", "0x030200", None),         # no driver
                ("0000:00:02.0", "0x8086", "0x030000", "i915"),       # another vendor
            ])
            self.assertEqual(routing.node_gpus(sysfs),
                             ["0000:18:00.0", "0000:2a:00.0", "0000:9a:00.0", "0000:b7:00.0"])
            # CUDA and NVML spell the address in upper case, NVML with an 8-digit domain.
            self.assertEqual(routing.node_gpu_index("0000:18:00.0", sysfs), 0)
            self.assertEqual(routing.node_gpu_index("0000:9A:00.0", sysfs), 2)
            self.assertEqual(routing.node_gpu_index("00000000:B7:00.0", sysfs), 3)
            with self.assertRaises(kvshade.InvalidArgument):
                routing.node_gpu_index("0000:3b:00.0", sysfs)
            with self.assertRaises(kvshade.InvalidArgument):
                routing.node_gpu_index("GPU-1234", sysfs)


if __name__ == "__main__":
    unittest.main()
