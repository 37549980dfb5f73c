#!/usr/bin/env python3
"""Time to open (and close) a same-node LocalDecoder over a small session, three opens per
daemon, for two device arena sizes: what a worker pays per decoder beyond the session's
own values (mapping the daemon's device arena by CUDA IPC, the export itself). Behind
bench/RESULTS.md "Ingest: time until a session is ready" (the figures around ingest).

Usage (GPU machine, from the repository root, with KVSHADE_SERVER and KVSHADE_LIB set and
client/python on PYTHONPATH): KVSHADE_TEST_BACKEND=cuda python3 bench/probes/decoder_open.py
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from kvshade_testutil import Server  # noqa: E402

import kvshade  # noqa: E402
from kvshade.decoders.local import LocalDecoder  # noqa: E402

L, HQ, H, D, N = 32, 32, 8, 128, 4096


def main():
    for budget in ("48GiB", "4GiB"):
        srv = Server("--device-budget", budget, "--host-budget", "16GiB")
        c = kvshade.Client(srv.target)
        c.wait_ready(30)
        rng = np.random.default_rng(1)
        spec = kvshade.ModelSpec("probe/open", L, HQ, H, D)
        sids = []
        for _ in range(3):
            cr = c.create_session(spec, kvshade.Profile("shadow"), rng.integers(0, 30000, N).tolist())
            with c.ingest(cr.session_id, "bf16") as ing:
                for layer in range(L):
                    ing.layer(layer, rng.standard_normal((N, H, D)).astype(np.float32),
                              rng.standard_normal((N, H, D)).astype(np.float32))
                ing.commit()
            sids.append(cr.session_id)
        for s in sids:
            a = c.attach(s, "probe").attachment_id
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dec = LocalDecoder(c, [a], backend="cuda:0")
            t1 = time.perf_counter()
            dec.close()
            t2 = time.perf_counter()
            print(f"device_budget {budget}: open {1e3 * (t1 - t0):.1f} ms close {1e3 * (t2 - t1):.1f} ms", flush=True)
            c.detach(a)
        for s in sids:
            c.close_session(s)
        c.close()
        srv.stop()


if __name__ == "__main__":
    main()
