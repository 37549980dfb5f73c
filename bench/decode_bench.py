#!/usr/bin/env python3
"""Decode through kvshade against dense attention, in one run, on one GPU.

Two tables (bench/RESULTS.md "Decode attention: kvshade against stock SDPA" and "End-to-end
decode against `DynamicCache`"):

  attention: one layer of Llama-3-8B shape (8 KV heads, 32 query heads, head dim 128) at a
    long context, batch B: kvshade same-node (kvshade.decoders.local.LocalDecoder: select +
    reconstruct into slot buffers + attend, in this process, over state the daemon
    exports) against stock torch SDPA over a GPU-resident bf16 cache (cuDNN, flash and
    memory-efficient backends each forced; the best is the baseline). Every figure beside
    its HBM floor: the bytes each must read over 4.8 TB/s (H200 peak).
    Sessions of one batch share one ingested document (prefix reuse); each has its own
    attachment, slot table and query.

  e2e: `model(...)` decode steps of a randomly initialised Llama-3-8B-shaped model
    (transformers, bf16, 32 layers, hidden 4096, 32/8 heads, head dim 128) after a prompt
    of --e2e-tokens, batch --e2e-batch: DynamicCache + SDPA, kvshade.integrations.hf_cache with
    decode="local", and with decode="rpc" (mode "rpc-spec": with speculate=True)
    (kvshade.decoders.remote.RemoteDecoder: one select per
    layer over the UCX data plane (--ucx, busy polling --busy-poll-us on both sides), misses
    delivered by --e2e-delivery, attention in this process). ms/token median and p90.
    Modes ingest-device, ingest-ucx, ingest-grpc: the same prompt's session for a remote
    worker (decode="rpc", a few steps to check it), its layers streamed during the prefill
    from this GPU by CUDA IPC, or from pinned host memory over the UCX data plane (--ucx) or
    over gRPC; "ready after prefill" is what each adds to the DynamicCache prefill, and the
    three must decode the same tokens (they ingest the same bytes).

Usage (on the GPU machine, daemon binary from the bundle):
  python3 bench/decode_bench.py --server .gpu/bin/kvshade-server [--attn-tokens 131072]
      [--batches 1,8,24,48] [--e2e-tokens 32768] [--e2e-steps 32] [--skip-e2e]
      [--e2e-modes local,rpc,ingest-device,ingest-ucx,ingest-grpc] [--e2e-delivery auto] [--ucx shm,self] [--busy-poll-us 2000]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kvshade  # noqa: E402
from kvshade.decoders.local import LocalDecoder  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e peak


def start_server(binary, extra, ucx="", busy_poll_us=50, gpu=None):
    d = tempfile.mkdtemp(prefix="kvshade-bench-")
    if ucx:
        cfg = os.path.join(d, "kvshade.yaml")
        with open(cfg, "w") as f:
            f.write('ucx:\n  enable: true\n  transports: "%s"\n  busy_poll_us: %d\n' % (ucx, busy_poll_us))
        extra = ["-c", cfg] + list(extra)
    port_file = os.path.join(d, "port")
    log = open(os.path.join(d, "server.log"), "w")
    import socket
    with socket.socket() as sock:  # a free port for /metrics (stage timings below)
        sock.bind(("127.0.0.1", 0))
        global METRICS_PORT
        METRICS_PORT = sock.getsockname()[1]
    args = [binary, "--listen", "127.0.0.1:0", "--port-file", port_file, "--backend", "cuda",
            "--metrics-listen", "127.0.0.1", "--metrics-port", str(METRICS_PORT)] + extra
    env = dict(os.environ)
    if gpu is not None:  # the daemon on its own GPU (as a disaggregated deployment runs it)
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    for _ in range(600):
        if os.path.exists(port_file) and open(port_file).read().strip():
            break
        if p.poll() is not None:
            raise RuntimeError("server exited: " + open(log.name).read())
        time.sleep(0.1)
    target = "127.0.0.1:" + open(port_file).read().strip()
    c = kvshade.Client(target, max_message_bytes=512 << 20, timeout=900.0)
    c.wait_ready(60)
    return p, c, log.name


METRICS_PORT = 0


def stage_seconds():
    """{stage: (total seconds, count)} from the daemon's kvshade_stage_duration_seconds."""
    import urllib.request
    out = {}
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        for suffix, i in (("_sum", 0), ("_count", 1)):
            head = "kvshade_stage_duration_seconds" + suffix + "{"
            if line.startswith(head):
                stage = line.split('stage="', 1)[1].split('"', 1)[0]
                cur = list(out.get(stage, (0.0, 0)))
                cur[i] = float(line.rsplit(" ", 1)[1])
                out[stage] = tuple(cur)
    return out


def cuda_time(fn, reps, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def sdpa_best(q, k, v):
    """Median ms of the best forced SDPA backend, and its name."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    best = None
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
                f()
                ms = cuda_time(f, 20)
        except Exception as e:  # noqa: BLE001 - a backend that refuses the shape is skipped
            print(f"  sdpa {name}: not available for this shape ({str(e).splitlines()[0][:80]})")
            continue
        if best is None or ms < best[0]:
            best = (ms, name)
    return best


def attention_table(c, args):
    n, h, hq, d = args.attn_tokens, 8, 32, 128
    C = 8
    budget = args.budget
    rng = np.random.default_rng(0)
    model = kvshade.ModelSpec("bench/attn-%d" % n, 1, hq, h, d)
    profile = kvshade.Profile("shadow", sparse_budget=budget, value_codec=args.codec)
    ids = rng.integers(0, 32000, n).tolist()
    # Keys with structure (low-rank + noise), values random: the shape of real KV.
    lat = rng.standard_normal((n, 64)).astype(np.float32)
    mix = rng.standard_normal((64, h * d)).astype(np.float32) / 8
    k = (lat @ mix + 0.1 * rng.standard_normal((n, h * d)).astype(np.float32)).reshape(n, h, d)
    v = rng.standard_normal((n, h, d)).astype(np.float32)
    t0 = time.time()
    created = c.create_session(model, profile, ids)
    with c.ingest(created.session_id, "bf16") as ing:
        ing.layer(0, k, v)
        ing.commit()
    print(f"attention: ingested {n} tokens in {time.time() - t0:.1f} s")
    sessions = [created.session_id]
    rows = []
    kd = torch.from_numpy(k).to(torch.bfloat16).cuda()
    vd = torch.from_numpy(v).to(torch.bfloat16).cuda()
    for B in args.batches:
        while len(sessions) < B:
            sessions.append(c.create_session(model, profile, ids).session_id)  # prefix reuse
        atts = [c.attach(s, "bench").attachment_id for s in sessions[:B]]
        dec = LocalDecoder(c, atts, backend="cuda", local_capacity=64)
        q = torch.randn(B, hq, d, device="cuda").to(torch.bfloat16)
        kn = torch.randn(B, h, d, device="cuda").to(torch.bfloat16)
        vn = torch.randn(B, h, d, device="cuda").to(torch.bfloat16)
        out = torch.empty(B, hq, d, device="cuda", dtype=torch.float32)
        # Steady state with drifting queries (a fresh query per rep: misses happen).
        qs = [q + 0.05 * torch.randn_like(q) for _ in range(8)]
        i = [0]

        def step():
            dec.attend(0, qs[i[0] % len(qs)], kn, vn, out)
            i[0] += 1
        kv_ms = cuda_time(step, 50)
        # The same step captured once in a CUDA graph and replayed (what a runtime that
        # captures its decode step gets): the query is copied into the captured buffer.
        q_static = qs[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dec.attend(0, q_static, kn, vn, out)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dec.attend(0, q_static, kn, vn, out)

        def step_graph():
            q_static.copy_(qs[i[0] % len(qs)])
            graph.replay()
            i[0] += 1
        kv_graph_ms = cuda_time(step_graph, 50)
        # Dense: the same tokens resident as [B, h, n, d] bf16.
        kk = kd.transpose(0, 1).unsqueeze(0).expand(B, h, n, d).contiguous()
        vv = vd.transpose(0, 1).unsqueeze(0).expand(B, h, n, d).contiguous()
        qq = q.unsqueeze(2).transpose(1, 2).reshape(B, hq, 1, d)
        best = sdpa_best(qq, kk, vv)
        del kk, vv
        torch.cuda.empty_cache()
        dense_floor = B * 2 * n * h * d * 2 / HBM_BYTES_PER_S * 1e3
        # kvshade reads: landmarks [n/C, h, d], static + slot rows [(s + k*C), h, d] x2, A rows
        # of the misses (small): the landmark pass dominates.
        kv_floor = B * ((n // C) * h * d * 2 + 2 * (budget * C + 49 * C) * h * d * 2) / HBM_BYTES_PER_S * 1e3
        rows.append({"batch": B, "kvshade_ms": kv_ms, "kvshade_graph_ms": kv_graph_ms,
                     "kvshade_floor_ms": kv_floor,
                     "sdpa_ms": best[0] if best else None, "sdpa_backend": best[1] if best else None,
                     "dense_floor_ms": dense_floor,
                     "speedup": (best[0] / kv_ms) if best else None})
        print(f"  B={B:3d}: kvshade {kv_ms:.3f} ms, graph {kv_graph_ms:.3f} ms (floor {kv_floor:.3f}) | sdpa {best[1]} {best[0]:.3f} ms "
              f"(floor {dense_floor:.3f}) | {best[0] / kv_ms:.2f}x")
        dec.close()
        for a in atts:
            c.detach(a)
    return rows


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=max(131072, args.e2e_tokens + 1024), rope_theta=500000.0,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    import transformers
    # dtype at construction (not .to()): the rotary inv_freq buffer stays fp32, as when a
    # checkpoint is loaded. transformers 5 spells it `dtype`, 4.x `torch_dtype`.
    dkw = {"dtype": torch.bfloat16} if int(transformers.__version__.split(".")[0]) >= 5 else {
        "torch_dtype": torch.bfloat16}
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", **dkw).eval()
    return model


def decode_loop(model, cache, first_logits, steps, n_prompt):
    times, toks = [], []
    nxt = first_logits[:, -1:].argmax(-1)
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True,
                        cache_position=torch.tensor([n_prompt + i], device="cuda"))
        nxt = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        toks.append(int(nxt[0, 0]))
    return times, toks


def e2e_table(c, args, ucx_client=None):
    from transformers import DynamicCache
    from kvshade.integrations import hf_cache
    model = build_model(args)
    n, B = args.e2e_tokens, args.e2e_batch
    # B > 1: B copies of one prompt (many questions over one document, decoded together):
    # kvshade ingests it once and the other sessions reuse the cached prefix; the dense
    # cache holds B copies. Each sequence still decodes on its own slot tables.
    ids = torch.randint(0, 32000, (1, n), device="cuda").repeat(B, 1)
    rows = []
    # Warm-up (kernel selection, allocator growth, lazy module init) so that the timed
    # prefill below is the prefill a serving process pays, not a first call's.
    with torch.no_grad():
        model(input_ids=ids[:, :1024], past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
    torch.cuda.synchronize()
    # DynamicCache + SDPA.
    cache = DynamicCache()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    times, dense_toks = decode_loop(model, cache, out.logits, args.e2e_steps, n)
    rows.append({"config": "DynamicCache + SDPA", "batch": B, "ms_median": statistics.median(times[2:]),
                 "ms_p90": float(np.percentile(times[2:], 90)), "prefill_s": prefill_s,
                 "gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30})
    del cache, out
    torch.cuda.empty_cache()
    print(f"e2e {n} x{B}: dense {rows[-1]['ms_median']:.2f} ms/step = {B * 1e3 / rows[-1]['ms_median']:.0f} "
          f"tokens/s (prefill {prefill_s:.1f} s)")
    modes = {"local": args.e2e_steps, "rpc": args.e2e_steps, "rpc-spec": args.e2e_steps,
             # Ingest paths (a remote worker's session, decoded by RemoteDecoder for a few
             # steps to check it): from this GPU by CUDA IPC, or streamed from host memory over
             # the UCX data plane or over gRPC while the prefill runs.
             "ingest-device": 8, "ingest-ucx": 8, "ingest-grpc": 8}
    runs = []
    for m in [m for m in args.e2e_modes.split(",") if m]:
        runs.append((m, modes[m], "first"))
        if m == "local":
            # A serving process pays some costs once (its CUDA context for the decoder, the
            # mapping of the daemon's exported memory): a second session over another
            # prompt (nothing reused) shows what every later request pays.
            runs.append((m, modes[m], "next"))
    for mode, steps, which in runs:
        prompt = ids if which == "first" else torch.randint(0, 32000, (1, n), device="cuda").repeat(B, 1)
        hf_cache.enable(model)
        torch.cuda.reset_peak_memory_stats()
        # The RPC path as a worker on another node would run it: its data calls over UCX.
        client = ucx_client if (mode.startswith("rpc") or mode == "ingest-ucx") and ucx_client is not None else c
        if mode == "ingest-ucx" and client is c:
            raise SystemExit("mode ingest-ucx needs --ucx")
        ingest_mode = mode.startswith("ingest-")
        kc = hf_cache.KvShadeCache(client, model, kvshade.Profile("shadow", value_codec=args.codec),
                                   prompt_ids=prompt if B > 1 else prompt[0],
                                   decode="rpc" if ingest_mode else mode.split("-")[0],
                                   speculate=mode == "rpc-spec",
                                   # The ingest modes ingest the same prompt each: a model id of
                                   # their own, so that none reuses another's cached prefix.
                                   model_id="bench/llama3-8b-random" + ("/" + mode if ingest_mode else ""),
                                   delivery=args.e2e_delivery,
                                   # rpc: decode as a remote worker would; the prompt still comes
                                   # from this GPU (the ingest modes measure the ingest paths)
                                   ingest={"ingest-device": "device", "ingest-ucx": "host", "ingest-grpc": "host"}.get(
                                       mode, "device" if mode.startswith("rpc") else "auto"))
        before = stage_seconds()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model(input_ids=prompt, past_key_values=kc, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        forward_end = time.perf_counter()
        kc.wait_ready()  # the commit and the decoder open may still run after the forward
        torch.cuda.synchronize()
        ready_s = time.perf_counter() - t0
        # The daemon's ingest stages during this prefill (seconds summed over layers).
        after = stage_seconds()
        # With the export the decoder's open asks for (and the static-set and tail caches it
        # builds on a session's first export).
        ingest_stages = {k: round(v[0] - before.get(k, (0.0, 0))[0], 4) for k, v in after.items()
                         if (k.startswith("ingest") or k in ("export", "static_set"))
                         and v[0] - before.get(k, (0.0, 0))[0] > 0}
        times, toks = decode_loop(model, kc, out.logits, steps, n)
        agree = sum(a == b for a, b in zip(toks, dense_toks)) / len(toks) if which == "first" else None
        agree_local = None
        if mode == "local" and which == "first":
            local_toks = toks
        elif mode.startswith("rpc") and "local" in args.e2e_modes:
            agree_local = sum(a == b for a, b in zip(toks, local_toks)) / len(toks)
        # Every ingest path ingests the same bytes, so the sessions decode the same tokens.
        tokens_equal = None
        if mode == "ingest-device":
            device_ingest_toks = toks
        elif ingest_mode and "ingest-device" in args.e2e_modes:
            tokens_equal = toks == device_ingest_toks[:len(toks)]
        ingest_bytes = 2 * n * B * model.config.num_hidden_layers * model.config.num_key_value_heads * \
            model.config.head_dim * 2
        name = f"kvshade {mode}" + (" (next session)" if which == "next" else "")
        rows.append({"config": name, "batch": B, "ms_median": statistics.median(times[1:]),
                     "ms_p90": float(np.percentile(times[1:], 90)), "prefill_plus_ingest_s": ready_s,
                     "steps": steps, "greedy_agreement_with_dense": agree,
                     "gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
                     "local_error": str(kc.local_error) if kc.local_error else None,
                     "delivery": kc.remote.delivery if kc.remote is not None else None,
                     "ucx": args.ucx if client is not c else None,
                     "hit_ratio": kc.hit_ratio,
                     "remote_stats": kc.remote.stats() if kc.remote is not None else None,
                     "greedy_agreement_local_vs_rpc": agree_local, "ingest_gib": ingest_bytes / 2**30,
                     "host_ingest_times": kc.host_ingest_times,
                     "ucx_fallbacks": client.ucx_fallbacks if client is not c else None,
                     "tokens_equal_device_ingest": tokens_equal})
        # Ready after prefill: how much later than the dense prefill the session is ready
        # (the adapter ingests each layer while the prefill computes the next).
        rows[-1]["ready_after_prefill_s"] = ready_s - prefill_s
        rows[-1]["ingest_stage_seconds"] = ingest_stages
        # Where the time after the forward went: each milestone of the ingest's end, in
        # seconds after the forward ended (negative: before it).
        rows[-1]["ready_milestones_s"] = {k: round(v - forward_end, 4) for k, v in kc.ready_times.items()}
        print("ready milestones (s after the forward):", rows[-1]["ready_milestones_s"])
        print("daemon ingest stages (s, summed over layers):", ingest_stages)
        print(f"e2e {n} x{B}: {name} {rows[-1]['ms_median']:.2f} ms/step = "
              f"{B * 1e3 / rows[-1]['ms_median']:.0f} tokens/s "
              f"(prefill+ingest {ready_s:.1f} s = prefill + {ready_s - prefill_s:.2f} s"
              + (f", greedy agreement {agree:.2f})" if agree is not None else ")"))
        kc.close(close_session=True)
        del kc, out
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--attn-tokens", type=int, default=131072)
    ap.add_argument("--batches", default="1,8,24,48")
    ap.add_argument("--budget", type=int, default=256, help="sparse_budget (chunks per KV head)")
    ap.add_argument("--codec", default="bf16")
    ap.add_argument("--e2e-tokens", type=int, default=32768)
    ap.add_argument("--e2e-steps", type=int, default=32)
    ap.add_argument("--e2e-batch", type=int, default=1)
    ap.add_argument("--e2e-modes", default="local,rpc")
    ap.add_argument("--e2e-delivery", default="auto", help="RemoteDecoder delivery of the rpc mode")
    ap.add_argument("--ucx", default="shm,self", help="UCX_TLS of the daemon's data plane and the rpc "
                    "mode's client (\"\" = the rpc mode over gRPC)")
    ap.add_argument("--busy-poll-us", type=int, default=2000, help="ucx busy_poll_us of daemon and client")
    ap.add_argument("--daemon-gpu", type=int, default=None,
                    help="run the daemon on this GPU (CUDA_VISIBLE_DEVICES), the model on cuda:0")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--skip-attn", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    args.batches = [int(x) for x in args.batches.split(",") if x]
    proc, c, log = start_server(args.server, ["--device-budget", "48GiB", "--host-budget", "96GiB",
                                               "--max-message-bytes", "512MiB"], args.ucx, args.busy_poll_us,
                          gpu=args.daemon_gpu)
    ucx_client = None
    if args.ucx:
        ucx_client = kvshade.Client(c.target, max_message_bytes=512 << 20, timeout=900.0, use_ucx=True,
                                    ucx_transports=args.ucx, ucx_busy_poll_us=args.busy_poll_us)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        if not args.skip_attn:
            result["attention"] = attention_table(c, args)
        if not args.skip_e2e:
            result["e2e"] = e2e_table(c, args, ucx_client)
    finally:
        proc.terminate()
        proc.wait(30)
        print("server log:", log)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
