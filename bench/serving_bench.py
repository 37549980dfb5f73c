#!/usr/bin/env python3
"""Document QA under Poisson arrivals on one GPU: kvshade beside the dense runtimes a user
would pick instead, on the same requests and arrival times, in one run.

Workload: --docs documents of --doc-tokens random tokens; request i asks a question of
--question-tokens random tokens about document i % docs (prompt = document + question) and
generates --max-new-tokens tokens greedily. Requests arrive as a Poisson process of --rate
per second (seeded). Model: randomly initialised Llama-3-8B shape, bf16 (bench/capacity_bench.py).

Rows (--configs, run in this order):
  kvshade          kvshade.integrations.serving.Generator: each prompt is prefilled through
                   hf_cache.KvShadeCache (its layers streamed to a daemon on the same GPU,
                   in chunks of --prefill-chunk between decode steps) and joins one decode
                   batch between steps once its session has committed. Each request passes
                   the document's length, rounded down to a multiple of 256 (the prefix
                   block; the daemon's default chunk size divides it), as a segment end
                   (--segment-ends, on by default), so the daemon caches the document as a
                   segment of its own and every later question over it reuses the document
                   and ingests only the question (docs/DESIGN.md "Segment ends"); the
                   Generator keeps the document's exact K/V in host memory
                   (--prefix-device-gib on the GPU, --prefix-cache-gib in host memory), so a
                   later question's prefill starts after it.
  kvshade-cb       kvshade behind transformers' own ContinuousBatchingManager
                   (kvshade.integrations.hf_batching), requests added at their arrival times.
  transformers-cb  stock transformers continuous batching (ContinuousBatchingManager: paged
                   attention, its own scheduler and chunked prefill), requests added at their
                   arrival times: the strongest dense runtime.
  dynamic          a server without continuous batching: one request at a time in arrival
                   order, model.generate with DynamicCache (SDPA).
  transformers     generate_batch with every request submitted at once (no arrival times):
                   a reference for the stock runtime's decode rate, not arrival for arrival.
Each kvshade row has a daemon of its own. Reported per row: throughput (generated tokens /
makespan), time to first token from arrival (p50, p99), time per output token (TPOT: each
request's (last token - first token) / (tokens - 1), p50 and p99 over the requests, as
serving benchmarks define it) and the inter-token latency (ITL: p50, p99 over every gap
between two tokens of a request); for the kvshade Generator row also the GPU
memory in use (every process, sampled each step), the daemon's host memory, prefix reuse
(reused tokens per request, the daemon's prefix lookups and hits), and the daemon's and the
worker's time per stage. Every row also has the peak GPU memory in use over its run (every
process's, sampled ten times a second: gpu_used_peak_sampled_gib).

Usage (GPU machine):
  python3 bench/serving_bench.py --server .gpu/bin/kvshade-server [--doc-tokens 32768]
      [--docs 2] [--requests 16] [--rate 0.5] [--max-new-tokens 32] [--max-batch 16]
      [--prefill-chunk 4096 [--decode-stall 1.5]] [--no-segment-ends]
      [--configs kvshade,kvshade-cb,transformers-cb,dynamic] [--json f]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kvshade  # noqa: E402
from capacity_bench import GIB, build_model, gpu_used_gib  # noqa: E402
from decode_bench import stage_seconds, start_server  # noqa: E402


class GpuPeak:
    """The largest GPU memory in use (every process's: cudaMemGetInfo) while the block runs,
    sampled every `every` seconds on a thread: `with GpuPeak() as peak: ...; peak.gib`."""

    def __init__(self, every=0.1):
        self.every, self.gib = every, 0.0
        self._stop = threading.Event()

    def _loop(self):
        while not self._stop.is_set():
            self.gib = max(self.gib, gpu_used_gib())
            self._stop.wait(self.every)

    def __enter__(self):
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.gib = max(self.gib, gpu_used_gib())


def pct(xs, p):
    return float(np.percentile(xs, p)) if xs else None


def latency_fields(times_per_request):
    """TPOT and ITL in ms from each request's token times (seconds, in order): TPOT per
    request, (last - first) / (tokens - 1) over the requests with two tokens or more; ITL over
    every gap between two consecutive tokens."""
    tpot = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in times_per_request if len(ts) > 1]
    itl = [b - a for ts in times_per_request for a, b in zip(ts, ts[1:])]

    def ms(xs, p):
        v = pct(xs, p)
        return None if v is None else v * 1e3
    return {"tpot_p50_ms": ms(tpot, 50), "tpot_p99_ms": ms(tpot, 99),
            "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99)}


def profile_of(args):
    """The kvshade rows' profile: shadow at the server's defaults, with --profile settings."""
    settings = {}
    for item in args.profile:
        key, _, value = item.partition("=")
        for parse in (int, float, str):
            try:
                settings[key] = parse(value)
                break
            except ValueError:
                pass
    return kvshade.Profile("shadow", **settings)


SEGMENT_END_ALIGN = 256  # the prefix block; a multiple of the daemon's default chunk size (8)


def document_end(args):
    """The segment end each request passes: the document's length, rounded down to the
    alignment the daemon takes (none when that leaves nothing or the whole prompt)."""
    end = args.doc_tokens // SEGMENT_END_ALIGN * SEGMENT_END_ALIGN
    return (end,) if args.segment_ends and 0 < end < args.doc_tokens + args.question_tokens else ()


def workload(args):
    rng = np.random.default_rng(args.seed)
    docs = [rng.integers(10, 120000, args.doc_tokens).tolist() for _ in range(args.docs)]
    prompts = [docs[i % args.docs] + rng.integers(10, 120000, args.question_tokens).tolist()
               for i in range(args.requests)]
    arrivals = np.cumsum(rng.exponential(1.0 / args.rate, args.requests)).tolist()
    arrivals = [a - arrivals[0] for a in arrivals]  # the first request at t = 0
    return prompts, arrivals


def run_kvshade(c, model, prompts, arrivals, args):
    from kvshade.integrations import serving
    gen = serving.Generator(c, model, profile_of(args), max_batch=args.max_batch,
                            model_id="bench/serving-%d" % args.seed, local_capacity=max(64, args.max_new_tokens),
                            prefill_chunk_tokens=args.prefill_chunk or None,
                            prefix_cache_bytes=int(args.prefix_cache_gib * GIB),
                            prefix_cache_device_bytes=int(args.prefix_device_gib * GIB),
                            history_device_bytes=int(args.history_device_gib * GIB),
                            decode_stall=args.decode_stall or None)
    # Warm-up: one request of the workload's length (kernel selection, allocator, the
    # decoder's first mapping; a shorter prompt could resolve another value codec).
    ends = document_end(args)
    warm = gen.submit(prompts[0], 2, segment_ends=ends)
    gen.run()
    if warm.error is not None:
        raise warm.error
    gen.chunk_times.clear()  # the workload's alone
    gen.prefill_forwards.clear()
    gen.steps.clear()
    reqs, memory, steps = [], [], []
    stages0 = stage_seconds()
    prefix0 = c.stats()
    t0 = time.perf_counter()
    nxt = 0
    host_peak = 0.0
    while nxt < len(prompts) or gen.busy:
        now = time.perf_counter() - t0
        while nxt < len(prompts) and arrivals[nxt] <= now:
            r = gen.submit(prompts[nxt], args.max_new_tokens, segment_ends=ends)
            r.submitted_at = t0 + arrivals[nxt]  # waiting to be submitted counts
            reqs.append(r)
            nxt += 1
        if not gen.busy:
            time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - t0)))
            continue
        t_step = time.perf_counter()
        gen.step()
        steps.append(time.perf_counter() - t_step)
        st = c.stats()
        host_peak = max(host_peak, st["host_bytes_used"] / GIB)
        memory.append((round(time.perf_counter() - t0, 3), round(gpu_used_gib(), 2), gen.cache.batch))
    makespan = time.perf_counter() - t0
    prefix1 = c.stats()
    # The daemon's time per pipeline stage over the workload (seconds, calls): where an
    # ingest or a decode step spends it.
    stages1 = stage_seconds()
    daemon_stages = {k: [round(v[0] - stages0.get(k, (0, 0))[0], 3), int(v[1] - stages0.get(k, (0, 0))[1])]
                     for k, v in stages1.items() if v[1] > stages0.get(k, (0, 0))[1]}
    gen.close()
    failed = [r for r in reqs if r.finish_reason == "error"]
    if failed:
        raise RuntimeError("%d requests failed, the first: %s" % (len(failed), failed[0].error))
    ttft = [r.ttft for r in reqs]
    first = [r.tpot[0] for r in reqs if r.tpot]
    later = [g for r in reqs for g in r.tpot[1:]]
    return {"config": "kvshade serving.Generator", "requests": len(reqs), "decode_stall": args.decode_stall or None,
            "prefill_chunk": args.prefill_chunk or None,
            "throughput_tokens_per_s": sum(len(r.tokens) for r in reqs) / makespan, "makespan_s": makespan,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            **latency_fields([r.token_times for r in reqs]),
            # The gap after the first token (it spans the session's commit) apart from the rest.
            "first_gap_ms_p50": pct(first, 50) and pct(first, 50) * 1e3,
            "first_gap_ms_max": max(first) * 1e3 if first else None,
            "first_gap_ms_per_request": [round(g * 1e3, 1) for g in first],
            # What the first gap spans: the session's commit after the first token, the
            # join's calls to the daemon and mapping (on the request's thread, beside the
            # steps) and the step's join of it (adding it to the batch).
            "commit_ms_per_request": [r.commit_s and round(r.commit_s * 1e3, 1) for r in reqs],
            "prepare_ms_per_request": [r.prepare_s and round(r.prepare_s * 1e3, 1) for r in reqs],
            "join_ms_per_request": [r.join_s and round(r.join_s * 1e3, 1) for r in reqs],
            "itl_after_first_gap_p50_ms": pct(later, 50) and pct(later, 50) * 1e3,
            "itl_after_first_gap_p99_ms": pct(later, 99) and pct(later, 99) * 1e3,
            "gpu_used_peak_gib": max(m[1] for m in memory), "daemon_host_peak_gib": host_peak,
            "max_batch_seen": max(m[2] for m in memory),
            "segment_ends": list(ends),
            "reused_tokens_mean": statistics.mean(r.reused_tokens for r in reqs),
            "reused_tokens_per_request": [r.reused_tokens for r in reqs],
            "prefill_skipped_per_request": [r.prefill_skipped for r in reqs],
            "daemon_prefix_lookups": prefix1["prefix_lookups"] - prefix0["prefix_lookups"],
            "daemon_prefix_hits": prefix1["prefix_hits"] - prefix0["prefix_hits"],
            "step_ms_p50": pct(steps, 50) * 1e3, "step_ms_p99": pct(steps, 99) * 1e3,
            "step_ms_max": max(steps) * 1e3, "steps": len(steps), "daemon_stage_seconds": daemon_stages,
            "worker_chunk_seconds": {k: round(v, 3) for k, v in gen.chunk_times.items()},
            # Tokens of each prefill forward while sequences decoded (decode_stall sizes them).
            "prefill_tokens_while_decoding": [n for n, decoding in gen.prefill_forwards if decoding],
            # The ten slowest steps and what their time went to (Generator.steps).
            "slowest_steps": [{"at_s": round(r.started - t0, 3), "ms": round(r.seconds * 1e3, 1),
                               "admit_ms": round(r.admit_s * 1e3, 1), "prefill_ms": round(r.prefill_s * 1e3, 1),
                               "decode_ms": round(r.decode_s * 1e3, 1), "batch": r.batch, "joined": r.joined,
                               "prefill_tokens": r.prefill_tokens}
                              for r in sorted(gen.steps, key=lambda r: -r.seconds)[:10]],
            "memory_over_time": memory}


def _clock_of(stamp):
    """The clock a transformers timestamp was read from (perf_counter or time): the one whose
    value now is nearest to it."""
    now = {time.perf_counter: time.perf_counter(), time.time: time.time()}
    return min(now, key=lambda f: abs(now[f] - stamp))


def run_manager_arrivals(manager, prompts, arrivals, args, config):
    """The arrival workload through a transformers ContinuousBatchingManager (started here):
    each request is added at its arrival time (add_request), results are collected as they
    finish (get_result). TTFT and TPOT come from the request's token timestamps."""
    manager.start()
    try:
        warm = manager.add_request(prompts[0], request_id="warm", max_new_tokens=2)
        if manager.get_result(warm, timeout=600) is None:
            raise RuntimeError("the warm-up request did not finish")
        submitted, done = {}, {}
        t0 = time.perf_counter()
        nxt = 0
        while len(done) < len(prompts):
            now = time.perf_counter() - t0
            while nxt < len(prompts) and arrivals[nxt] <= now:
                rid = manager.add_request(prompts[nxt], request_id="r%d" % nxt,
                                          max_new_tokens=args.max_new_tokens, record_timestamps=True)
                submitted[rid] = t0 + arrivals[nxt]
                nxt += 1
            wait = arrivals[nxt] - (time.perf_counter() - t0) if nxt < len(prompts) else 5.0
            out = manager.get_result(timeout=max(0.001, wait))
            if out is not None:
                done[out.request_id] = out
                if getattr(out, "error", None):
                    raise RuntimeError("request %s failed: %s" % (out.request_id, out.error))
            elif nxt >= len(prompts) and time.perf_counter() - t0 > 1200:
                raise RuntimeError("the manager stopped finishing requests")
        makespan = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    ttft, times, toks = [], [], 0
    for rid, out in done.items():
        ts = list(getattr(out, "timestamps", None) or [])
        toks += len(out.generated_tokens)
        if ts:
            clock = _clock_of(ts[-1])
            # submitted is perf_counter-based: the same instant on the request's clock.
            offset = clock() - time.perf_counter()
            ttft.append(ts[0] - (submitted[rid] + offset))
            times.append(ts)
    return {"config": config, "requests": len(done), "throughput_tokens_per_s": toks / makespan,
            "makespan_s": makespan, "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            **latency_fields(times), "gpu_used_after_gib": gpu_used_gib()}


def run_transformers_cb_arrivals(model, prompts, arrivals, args):
    """Stock transformers continuous batching (paged attention, its own scheduler and CUDA
    graphs as it decides) under the same arrivals: the strongest dense runtime."""
    from transformers import GenerationConfig
    model.set_attn_implementation("sdpa")
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=cfg)
    try:
        return run_manager_arrivals(manager, prompts, arrivals, args,
                                    "transformers ContinuousBatchingManager (paged), arrivals")
    except Exception as e:  # noqa: BLE001 - reported: this transformers may lack or refuse it
        return {"config": "transformers ContinuousBatchingManager (paged), arrivals",
                "error": "%s: %s" % (type(e).__name__, str(e)[:300])}
    finally:
        model._cached_continuous_batching_manager = None
        torch.cuda.empty_cache()


def run_kvshade_cb_arrivals(c, model, prompts, arrivals, args):
    """kvshade behind transformers' continuous batching (kvshade.integrations.hf_batching) under the same
    arrivals."""
    from transformers import GenerationConfig
    from kvshade.integrations import hf_batching
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager = hf_batching.enable(model, c, profile_of(args), generation_config=cfg,
                                 model_id="bench/serving-cb-%d" % args.seed,
                                 local_capacity=max(64, args.max_new_tokens))
    try:
        return run_manager_arrivals(manager, prompts, arrivals, args,
                                    "kvshade.integrations.hf_batching (transformers' manager), arrivals")
    finally:
        hf_batching.disable(model)
        model.set_attn_implementation("sdpa")
        torch.cuda.empty_cache()


def run_dynamic_fifo(model, prompts, arrivals, args):
    """What a server without continuous batching does: one request at a time in arrival order,
    model.generate with transformers' DynamicCache (SDPA)."""
    from transformers import DynamicCache
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times, self.prompt_seen = [], False

        def put(self, value):
            if not self.prompt_seen:
                self.prompt_seen = True  # generate() puts the prompt first
                return
            self.times.append(time.perf_counter())

        def end(self):
            pass

    model.set_attn_implementation("sdpa")
    ttft, times, toks = [], [], 0

    def one(p, max_new):
        ids = torch.tensor([p], device="cuda")
        st = Stamps()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=DynamicCache(),
                                 max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                                 pad_token_id=0, streamer=st)
        return out.shape[1] - ids.shape[1], st.times

    one(prompts[0], 2)  # warm-up
    t0 = time.perf_counter()
    for p, a in zip(prompts, arrivals):
        now = time.perf_counter() - t0
        if a > now:
            time.sleep(a - now)
        n, stamps = one(p, args.max_new_tokens)
        toks += n
        ttft.append(stamps[0] - (t0 + a))
        times.append(stamps)
    makespan = time.perf_counter() - t0
    torch.cuda.empty_cache()
    return {"config": "DynamicCache generate, one request at a time, arrivals", "requests": len(prompts),
            "throughput_tokens_per_s": toks / makespan, "makespan_s": makespan,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            **latency_fields(times), "gpu_used_after_gib": gpu_used_gib()}


def run_transformers_cb(model, prompts, args):
    from transformers import GenerationConfig
    model.set_attn_implementation("sdpa")
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        out = model.generate_batch(inputs=prompts, generation_config=cfg, record_timestamps=True,
                                   progress_bar=False)
    except Exception as e:  # noqa: BLE001 - reported: this transformers may lack or refuse it
        return {"config": "transformers generate_batch", "error": "%s: %s" % (type(e).__name__, str(e)[:300])}
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    outs = list(out.values())
    toks = sum(len(getattr(o, "generated_tokens", []) or []) for o in outs)
    times = [list(o.timestamps) for o in outs if getattr(o, "timestamps", None)]
    return {"config": "transformers generate_batch (paged, all submitted at once)", "requests": len(outs),
            "throughput_tokens_per_s": toks / wall, "makespan_s": wall, **latency_fields(times),
            "gpu_used_after_gib": gpu_used_gib(),
            "output_fields": sorted(k for k in vars(outs[0]) if not k.startswith("_")) if outs else []}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--doc-tokens", type=int, default=32768)
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rate", type=float, default=0.5, help="arrivals per second")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="kvshade: prefill prompts in chunks of this many tokens between decode steps (0: whole)")
    ap.add_argument("--decode-stall", type=float, default=0,
                    help="kvshade: serving.Generator's decode_stall (with --prefill-chunk): size each prefill "
                         "chunk so that a step carrying it takes about this many times a plain decode step (0: off)")
    ap.add_argument("--no-segment-ends", dest="segment_ends", action="store_false",
                    help="kvshade: pass no segment end (each question's prompt is then cached as one "
                         "segment, and the document is reused only as the daemon splits it itself)")
    ap.add_argument("--profile", action="append", default=[], metavar="KEY=VALUE",
                    help="kvshade rows: a shadow profile setting (kvshade.Profile field), e.g. "
                         "refactor_threshold=1; repeatable")
    ap.add_argument("--prefix-cache-gib", type=float, default=8.0,
                    help="kvshade: serving.Generator's prefix_cache_bytes (host memory), in GiB")
    ap.add_argument("--prefix-device-gib", type=float, default=8.0,
                    help="kvshade: serving.Generator's prefix_cache_device_bytes, in GiB (with "
                         "--prefix-cache-gib 0: no prefix cache)")
    ap.add_argument("--history-device-gib", type=float, default=8.0,
                    help="kvshade: serving.Generator's history_device_bytes (a chunked prefill's "
                         "earlier chunks on the GPU), in GiB")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--configs", default="kvshade,kvshade-cb,transformers-cb,dynamic",
                    help="rows, in this order: kvshade (serving.Generator), kvshade-cb (kvshade.integrations.hf_batching "
                         "under transformers' manager), transformers-cb (stock ContinuousBatchingManager), "
                         "dynamic (DynamicCache generate, one request at a time), transformers "
                         "(generate_batch, every request submitted at once)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    prompts, arrivals = workload(args)
    model = build_model(args.doc_tokens + args.question_tokens + args.max_new_tokens + 1024)
    result = {"gpu": torch.cuda.get_device_name(), "args": vars(args), "rows": []}
    configs = args.configs.split(",")
    unknown = set(configs) - {"kvshade", "kvshade-cb", "transformers-cb", "dynamic", "transformers"}
    if unknown:
        ap.error("unknown configs: %s" % ", ".join(sorted(unknown)))
    for name, run in (("kvshade", run_kvshade), ("kvshade-cb", run_kvshade_cb_arrivals)):
        if name not in configs:
            continue
        # A daemon of its own per row: neither inherits the other's cached prefixes.
        proc, c, _ = start_server(args.server, ["--device-budget", "100GiB", "--host-budget", "100GiB",
                                                "--max-message-bytes", "512MiB"])
        try:
            with GpuPeak() as peak:
                row = run(c, model, prompts, arrivals, args)
            row["gpu_used_peak_sampled_gib"] = round(peak.gib, 2)
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                print("the daemon did not stop within 60 s of SIGTERM: killed", flush=True)
                proc.kill()
                proc.wait(30)
        print(json.dumps({k: v for k, v in row.items() if k != "memory_over_time"}), flush=True)
        result["rows"].append(row)
        torch.cuda.empty_cache()
    for name, run in (("transformers-cb", run_transformers_cb_arrivals), ("dynamic", run_dynamic_fifo)):
        if name in configs:
            with GpuPeak() as peak:
                row = run(model, prompts, arrivals, args)
            row["gpu_used_peak_sampled_gib"] = round(peak.gib, 2)
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
    if "transformers" in configs:
        row = run_transformers_cb(model, prompts, args)
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
