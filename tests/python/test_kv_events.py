"""KV-events on a real kvshade-server (--kv-events-endpoint): a ZMQ SUB socket, bound here
as an llm-d indexer binds it, receives the daemon's messages; each is decoded with plain
msgpack and checked against the vLLM KV-events layout (docs/API.md "KV-events"):
frames [topic, 8-byte big-endian sequence, payload], payload [ts, [event, ...]], events
["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name],
["BlockRemoved", hashes, medium], ["AllBlocksCleared"]. The workload: a start (cleared), two
prompts sharing their first block (stored, the shared block's hash equal), both closed, then a
third prompt whose registration evicts them (removed: exactly the stored hashes)."""
import time
import unittest

import numpy as np

from kvshade_testutil import Server, seed

import kvshade

try:
    import msgpack
    import zmq
except ImportError:  # python3-zmq, python3-msgpack (scripts/install-deps.sh)
    msgpack = zmq = None

L, HQ, H, D = 4, 2, 2, 64
BLOCK = 256
TOPIC = b"kv@kvshade-test@py-events"


@unittest.skipIf(zmq is None or msgpack is None, "python3-zmq and python3-msgpack are needed")
class KvEventsTest(unittest.TestCase):
    def setUp(self):
        self.rng = np.random.default_rng(seed())
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        port = self.sub.bind_to_random_port("tcp://127.0.0.1")
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        # The daemon connects (no '*' in the endpoint), like a vLLM pod to an llm-d indexer.
        # A small device budget: registering a prefix evicts cached ones no session holds.
        # (3 MiB: at 2 MiB the third prompt's ingest could find 0.86 MB free but no range of
        # the 0.39 MB its compression needs at once, the arena fragmented by the timing of
        # its own allocations; the test then failed on that, not on the events.)
        self.server = Server("--kv-events-endpoint", "tcp://127.0.0.1:%d" % port,
                             "--kv-events-topic", TOPIC.decode(), "--device-budget", "3MiB")
        self.c = kvshade.Client(self.server.target, timeout=30)
        self.c.wait_ready(20)
        self.messages = []

    def tearDown(self):
        self.c.close()
        rc = self.server.stop()
        self.sub.close(linger=0)
        self.ctx.term()
        self.assertEqual(rc, 0)

    def receive(self, until, timeout_s=20.0):
        """Receives messages until `until(events so far)` holds; returns every event."""
        end = time.monotonic() + timeout_s
        while not until(self.events()):
            left = end - time.monotonic()
            self.assertGreater(left, 0, "events so far: %r" % (self.events(),))
            if self.sub.poll(int(min(left, 0.5) * 1000)):
                self.messages.append(self.sub.recv_multipart())
        return self.events()

    def events(self):
        out = []
        for frames in self.messages:
            self.assertEqual(len(frames), 3)
            topic, seq, payload = frames
            self.assertEqual(topic, TOPIC)
            self.assertEqual(len(seq), 8)
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            self.assertIsInstance(batch, list)
            self.assertEqual(len(batch), 2)
            self.assertIsInstance(batch[0], float)
            self.assertLess(abs(batch[0] - time.time()), 600)
            out.extend(batch[1])
        return out

    def ingest(self, tokens):
        model = kvshade.ModelSpec("py-events", num_layers=L, num_query_heads=HQ, num_kv_heads=H, head_dim=D)
        created = self.c.create_session(model, kvshade.Profile("shadow", rank=8, sparse_budget=4, outliers=2),
                                        tokens)
        n = created.tokens_to_ingest
        k = self.rng.standard_normal((L, n, H, D)).astype(np.float32)
        v = self.rng.standard_normal((L, n, H, D)).astype(np.float32)
        with self.c.ingest(created.session_id) as ing:
            for l in range(L):
                ing.layer(l, k[l], v[l])
            ing.commit()
        return created.session_id

    def test_ingest_close_and_eviction(self):
        stored = lambda ev: [e for e in ev if e[0] == "BlockStored"]
        removed = lambda ev: [e for e in ev if e[0] == "BlockRemoved"]
        a = self.rng.integers(0, 32000, 2 * BLOCK + 40).astype(np.int32)
        b = np.concatenate([a[:BLOCK], self.rng.integers(0, 32000, BLOCK + 17).astype(np.int32)])
        sa = self.ingest(a)
        ev = self.receive(lambda ev: len(stored(ev)) >= 1)
        # b shares a's first block, then diverges inside a's segment: the daemon cuts b's
        # ingest at the block's end (docs/DESIGN.md "Segment ends"), so b stores two
        # segments, the shared block and its own second block.
        sb = self.ingest(b)
        ev = self.receive(lambda ev: len(stored(ev)) >= 3)
        ea, eb1, eb2 = stored(ev)[:3]
        for e in (ea, eb1, eb2):
            # ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name]
            self.assertEqual(len(e), 8)
            self.assertEqual(e[4], BLOCK)
            self.assertIsNone(e[5])
            self.assertEqual(e[6], "CPU")
            self.assertIsNone(e[7])
            self.assertTrue(all(isinstance(h, int) and 0 <= h < 2 ** 64 for h in e[1]))
        self.assertEqual(len(ea[1]), 2)  # whole blocks only: the 40 / 17 extra tokens are not keyed
        self.assertEqual((len(eb1[1]), len(eb2[1])), (1, 1))
        self.assertIsNone(ea[2])  # a chain's first segment
        self.assertIsNone(eb1[2])
        self.assertEqual(eb2[2], eb1[1][0])  # the second segment's parent block
        self.assertEqual(ea[3], [int(t) for t in a[:2 * BLOCK]])
        self.assertEqual(eb1[3], [int(t) for t in b[:BLOCK]])
        self.assertEqual(eb2[3], [int(t) for t in b[BLOCK:2 * BLOCK]])
        # Chained keys: the shared first block has one hash, the diverging second two.
        self.assertEqual(ea[1][0], eb1[1][0])
        self.assertNotEqual(ea[1][1], eb2[1][0])
        self.assertEqual(removed(ev), [])  # both sessions hold their prefixes

        self.c.close_session(sa)
        self.c.close_session(sb)
        self.assertEqual(removed(self.events()), [])  # closed, still cached
        # A third prompt's registration evicts the cached prefixes no session holds: with
        # its ~1.3 MB of segments the cached bytes exceed half the 3 MiB device budget until
        # they are gone (least recently used first). The shared block went over to b's first
        # segment: it is removed once, with that segment, not with a's.
        self.ingest(self.rng.integers(0, 32000, 4 * BLOCK).astype(np.int32))
        ev = self.receive(lambda ev: len(removed(ev)) >= 3)
        gone = removed(ev)
        for e in gone:
            self.assertEqual(len(e), 3)
            self.assertEqual(e[2], "CPU")
        self.assertEqual(sorted(tuple(e[1]) for e in gone[:3]),
                         sorted([(ea[1][1],), tuple(eb1[1]), tuple(eb2[1])]))
        # Sequence numbers: consecutive from where this subscriber joined.
        seqs = [int.from_bytes(f[1], "big") for f in self.messages]
        self.assertEqual(seqs, list(range(seqs[0], seqs[0] + len(seqs))))


if __name__ == "__main__":
    unittest.main()
