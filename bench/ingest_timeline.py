#!/usr/bin/env python3
"""Where the time between a prefill's end and a kvshade session being ready goes.

Runs bench/decode_bench.py's end-to-end table (local mode) with wall-clock events around
the transformers adapter's calls: session creation (first layer), each layer handed to the
daemon, the commit after the last layer, opening the same-node decoder (GPU synchronized
around it) and the start of each decode loop. The daemon logs session_created and
ingest_committed on the same clock. bench/RESULTS.md "Ingest: time until a session is ready"
has the figures it explains.

Usage (GPU machine): python3 bench/ingest_timeline.py --server .gpu/bin/kvshade-server
    [--tokens 131072]
"""
import argparse
import functools
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import decode_bench  # noqa: E402
import kvshade.client  # noqa: E402
import kvshade.integrations.hf_cache  # noqa: E402
import kvshade.decoders.local  # noqa: E402

EVENTS = []


def wrap(owner, name, label, sync=False):
    f = getattr(owner, name)

    @functools.wraps(f)
    def timed(*a, **k):
        if sync:
            torch.cuda.synchronize()
        EVENTS.append((time.time(), label + " start"))
        r = f(*a, **k)
        if sync:
            torch.cuda.synchronize()
        EVENTS.append((time.time(), label + " end"))
        return r
    setattr(owner, name, timed)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--tokens", type=int, default=131072)
    args = ap.parse_args()
    wrap(kvshade.integrations.hf_cache.KvShadeCache, "_begin_device_ingest", "create sessions + open streams")
    wrap(kvshade.client.Ingest, "layer_cuda", "layer")
    wrap(kvshade.client.Ingest, "commit", "commit")
    wrap(kvshade.decoders.local.LocalDecoder, "__init__", "open same-node decoder", sync=True)
    wrap(decode_bench, "decode_loop", "decode loop")
    sys.argv = [sys.argv[0], "--server", args.server, "--skip-attn", "--e2e-tokens", str(args.tokens),
                "--e2e-steps", "4", "--e2e-modes", "local"]
    decode_bench.main()
    t0 = EVENTS[0][0]
    for t, label in EVENTS:
        if not label.startswith("layer"):
            print(f"event {t:.3f} +{t - t0:8.3f} s  {label}")
    layers = [t for t, label in EVENTS if label == "layer end"]
    if layers:
        print(f"layers handed over: {len(layers)}, last at +{layers[-1] - t0:.3f} s")


if __name__ == "__main__":
    main()
