#!/usr/bin/env python3
"""Where a decode layer's time goes in kvshade.decoders.remote.RemoteDecoder (the transformers
adapter's decode="rpc" path), per delivery: the select call (Python + C ABI + data plane +
the daemon's select, reconstruct and delivery), applying its deltas, and the whole attend()
including attention, each median over the steps after the first two. Then a cProfile of
the cuda_ipc path. A session of the Llama-3-8B attention shape (32 layers, 8 KV / 32 query
heads, d 128) at server defaults, random K/V ingested from the GPU; queries cycle through
8 random ones, so most selected chunks miss (the delivery's worst case).

Usage (GPU machine, daemon binary from the bundle):
  python3 bench/remote_decoder_profile.py --server .gpu/bin/kvshade-server [--tokens 32768]
      [--steps 12] [--ucx shm,self] [--busy-poll-us 2000]
"""
import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))

import torch  # noqa: E402

import decode_bench  # noqa: E402
import kvshade  # noqa: E402
from kvshade.decoders.remote import RemoteDecoder  # noqa: E402

L, HQ, H, D = 32, 32, 8, 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ucx", default="shm,self")
    ap.add_argument("--busy-poll-us", type=int, default=2000)
    args = ap.parse_args()
    n = args.tokens
    proc, c, log = decode_bench.start_server(args.server, ["--device-budget", "48GiB", "--host-budget", "96GiB",
                                                           "--max-message-bytes", "512MiB"],
                                             args.ucx, args.busy_poll_us)
    try:
        uc = kvshade.Client(c.target, max_message_bytes=512 << 20, timeout=900.0, use_ucx=True,
                            ucx_transports=args.ucx, ucx_busy_poll_us=args.busy_poll_us)
        spec = kvshade.ModelSpec("remote-decoder-profile", L, HQ, H, D)
        s = c.create_session(spec, kvshade.Profile("shadow"), list(range(n)))
        with c.ingest(s.session_id) as ing:
            for layer in range(L):
                ing.layer_cuda(layer, torch.randn(n, H, D, device="cuda").bfloat16(),
                               torch.randn(n, H, D, device="cuda").bfloat16())
            ing.commit()
        qs = [torch.randn(1, HQ, D, device="cuda").bfloat16() for _ in range(8)]
        kn = torch.randn(1, H, D, device="cuda").bfloat16()
        print(f"# {n} tokens, {L} layers, h {H}, hq {HQ}, d {D}; ucx {args.ucx!r}, busy poll {args.busy_poll_us} us")
        for delivery in ("cuda_ipc", "ucx_rma"):
            dec = RemoteDecoder(uc, [s.session_id], spec, device="cuda", delivery=delivery)
            times = {"select": [], "apply": [], "attend": []}
            apply, select = dec._apply, uc.select

            def timed_apply(*args):
                t = time.perf_counter()
                apply(*args)
                torch.cuda.synchronize()
                times["apply"].append(time.perf_counter() - t)

            def timed_select(*a, **k):
                t = time.perf_counter()
                r = select(*a, **k)
                times["select"].append(time.perf_counter() - t)
                return r
            dec._apply, uc.select = timed_apply, timed_select
            try:
                for step in range(args.steps):
                    for layer in range(L):
                        torch.cuda.synchronize()
                        t = time.perf_counter()
                        dec.attend(layer, qs[(step + layer) % 8], kn, kn)
                        torch.cuda.synchronize()
                        times["attend"].append(time.perf_counter() - t)
            finally:
                uc.select = select
            st = dec.stats()
            print(f"{delivery}: per layer, median ms: " + ", ".join(
                f"{k} {statistics.median(v[2 * L:]) * 1e3:.3f}" for k, v in times.items())
                + f"; hit ratio {st['hits'] / max(st['selected'], 1):.3f}")
            dec.close()
        dec = RemoteDecoder(uc, [s.session_id], spec, device="cuda", delivery="cuda_ipc")
        prof = cProfile.Profile()
        prof.enable()
        for step in range(6):
            for layer in range(L):
                dec.attend(layer, qs[(step + layer) % 8], kn, kn)
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
        dec.close()
    finally:
        proc.terminate()
        proc.wait(30)
        print("server log:", log)


if __name__ == "__main__":
    main()
