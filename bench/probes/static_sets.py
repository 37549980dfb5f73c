#!/usr/bin/env python3
"""What an attach costs the transformers adapter's hook: Client.attach, then every layer's
static set and exact tail (GetStaticSet, widened to float32), as KvShadeKVCache.attach did
before it fetched them on first use. Llama-3-8B shape (32 layers, 8 KV heads of 128), a
shadow session at the server's defaults (48 outlier chunks, local window 32): the static
set's size does not depend on the prompt's length, so a short prompt stands for any.
Behind bench/RESULTS.md "Ingest" (the attach between the commit and the first step).

Usage (from the repository root, with KVSHADE_SERVER and KVSHADE_LIB set, e.g. the build's,
and client/python on PYTHONPATH):
  /usr/bin/python3 bench/probes/static_sets.py [--reps 3]
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))

import numpy as np  # noqa: E402
from kvshade_testutil import Server  # noqa: E402

import kvshade  # noqa: E402

L, HQ, H, D, N = 32, 32, 8, 128, 2048


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    srv = Server(backend="cpu")
    c = kvshade.Client(srv.target)
    c.wait_ready(30)
    rng = np.random.default_rng(1)
    spec = kvshade.ModelSpec("probe/static-sets", L, HQ, H, D)
    cr = c.create_session(spec, kvshade.Profile("shadow", rank=64), rng.integers(0, 30000, N).tolist())
    with c.ingest(cr.session_id, "bf16") as ing:
        for layer in range(L):
            ing.layer(layer, rng.standard_normal((N, H, D)).astype(np.float32),
                      rng.standard_normal((N, H, D)).astype(np.float32))
        ing.commit()
    for _ in range(a.reps):
        t0 = time.perf_counter()
        att = c.attach(cr.session_id, "probe")
        t1 = time.perf_counter()
        sets = [c.static_set(att.attachment_id, layer) for layer in range(L)]
        t2 = time.perf_counter()
        rows = sum(int(st.k.shape[1]) + int(st.tail_k.shape[0]) for st in sets)
        print("attach %.1f ms; %d static sets (%d rows per KV head in all, %.1f MB as float32) %.1f ms"
              % (1e3 * (t1 - t0), L, rows, sum(st.k.nbytes + st.v.nbytes + st.tail_k.nbytes + st.tail_v.nbytes
                                                for st in sets) / 1e6, 1e3 * (t2 - t1)), flush=True)
        c.detach(att.attachment_id)
    c.close_session(cr.session_id)
    c.close()
    srv.stop()


if __name__ == "__main__":
    main()
