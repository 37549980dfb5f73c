"""kvshade.routing (Python over the C ABI) against the C++ Router's own placement: the prefix
keys, weights and ranks that route_vectors (a C++ program over client::Router) prints for 64
fixed prompts and endpoint lists must be what Python computes; plus the properties callers
rely on (only the first route_prefix_tokens tokens count, removing an endpoint moves only its
keys) and the refusals."""
import json
import os
import subprocess
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


if __name__ == "__main__":
    unittest.main()
