#!/usr/bin/env python3
"""Served capacity on one GPU: how many long sequences each cache holds at once, and the
decode tokens/s of a whole model at that batch, kvshade beside dense caches in one run.

Model: a randomly initialised Llama-3-8B shape (transformers, bf16, 32 layers, hidden 4096,
32 query / 8 KV heads, head dim 128), greedy decode steps of one token per sequence
(`model(...)` forwards, eager, no CUDA graphs for any row). Rows, per context length n:

  dense prealloc + SDPA : a preallocated bf16 cache [B, 8, n + steps, 128] per layer (no
                          per-step copy: each step writes its token in place), attention by
                          stock torch SDPA (enable_gqa, no mask: the strongest dense decode a
                          user builds from stock parts)
  DynamicCache + SDPA   : transformers' DynamicCache and its sdpa attention (copies every
                          layer's cache at each step)
  kvshade               : sessions held by a daemon on the same GPU (shadow profile,
                          value_codec auto: int4 values in host memory at these lengths),
                          decoded by kvshade.integrations.serving.BatchCache (one same-node LocalDecoder)

Each configuration's batch grows until the GPU (or, for kvshade, the daemon's budgets)
cannot take another sequence, then decodes --steps steps at that batch ("largest batch";
tokens/s = B / step time), and at batch 1. The K/V are random (keys low-rank plus noise,
values Gaussian), distinct per sequence (no prefix sharing): decode cost and memory do not
depend on what the tokens are. GPU memory is the device's whole use (every process: the
daemon's included) read from cudaMemGetInfo; the worker's share is torch's reserved memory.
kvshade's row also gives what the daemon's device tier holds (its growth steps, used or not)
and each process's GPU memory as nvidia-smi counts it (CUDA contexts included).

Usage (GPU machine, daemon binary from the bundle):
  python3 bench/capacity_bench.py --server .gpu/bin/kvshade-server [--tokens 131072,32768]
      [--configs prealloc,dynamic,kvshade] [--steps 12] [--max-batch 64] [--kivi-group 32] [--json out.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import kvshade  # noqa: E402
from decode_bench import start_server  # noqa: E402

H, HQ, D, L = 8, 32, 128, 32
GIB = 2 ** 30


def gpu_used_gib():
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GIB


def gpu_by_process():
    """GiB of GPU memory each process holds, as the driver counts it ({pid: GiB}; the CUDA
    context included, which neither torch's reserved bytes nor the daemon's stats count);
    {} where nvidia-smi is missing or fails."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    used = {}
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            used[int(parts[0])] = used.get(int(parts[0]), 0) + int(parts[1]) / 1024  # MiB -> GiB
    return used


def build_model(max_pos):
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=L,
                      num_attention_heads=HQ, num_key_value_heads=H, head_dim=D, max_position_embeddings=max_pos,
                      rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    dkw = {"dtype": torch.bfloat16} if int(transformers.__version__.split(".")[0]) >= 5 else {
        "torch_dtype": torch.bfloat16}
    with torch.device("cuda"):
        return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", **dkw).eval()


# --- dense: a preallocated cache and stock SDPA -------------------------------------------------

def _prealloc_classes():
    from transformers.cache_utils import Cache, DynamicLayer

    class PreallocLayer(DynamicLayer):
        is_sliding = False

        def __init__(self, k, v, length):
            super().__init__()
            self.k, self.v, self.length = k, v, length
            self.keys, self.values = k[:, :, :length], v[:, :, :length]
            self.is_initialized = True
            self.dtype, self.device = k.dtype, k.device

        def update(self, key_states, value_states, *args, **kwargs):
            n = key_states.shape[2]
            self.k[:, :, self.length:self.length + n].copy_(key_states)
            self.v[:, :, self.length:self.length + n].copy_(value_states)
            self.length += n
            self.keys, self.values = self.k[:, :, :self.length], self.v[:, :, :self.length]
            return self.keys, self.values

        def get_seq_length(self, *args, **kwargs):
            return self.length

        def get_mask_sizes(self, query, *args, **kwargs):
            q = int(query.shape[0]) if isinstance(query, torch.Tensor) and query.dim() else int(query)
            return self.length + q, 0

        def get_max_cache_shape(self, *args, **kwargs):
            return -1

    class PreallocCache(Cache):
        def __init__(self, B, n, cap):
            layers = []
            for _ in range(L):
                k = torch.empty(B, H, cap, D, dtype=torch.bfloat16, device="cuda")
                v = torch.empty(B, H, cap, D, dtype=torch.bfloat16, device="cuda")
                k[:, :, :n].normal_()
                v[:, :, :n].normal_()
                layers.append(PreallocLayer(k, v, n))
            super().__init__(layers=layers)

    return PreallocCache


def dense_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Stock torch SDPA over the cache's views, GQA in the kernel (no repeated K/V), no mask
    (one query token attends every cached token)."""
    if query.shape[2] != 1:
        raise ValueError("dense_sdpa serves decode steps")
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2), None


def dynamic_cache(B, n):
    from transformers import DynamicCache
    c = DynamicCache()
    for li in range(L):
        k = torch.randn(B, H, n, D, dtype=torch.bfloat16, device="cuda")
        c.update(k, torch.randn_like(k), li)
    return c


def time_steps(step, steps):
    times = []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(i)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    warm = times[2:] if len(times) > 4 else times
    return statistics.median(warm), sorted(warm)[int(0.9 * (len(warm) - 1))]


def dense_row(model, kind, n, B, steps):
    """Decode steps at batch B; None when B does not fit."""
    from transformers import AttentionInterface
    from kvshade.integrations.hf_cache import register_sdpa_mask
    AttentionInterface.register("dense_sdpa", dense_sdpa)
    register_sdpa_mask("dense_sdpa")
    cache = None
    try:
        if kind == "prealloc":
            cache = _prealloc_classes()(B, n, n + steps + 1)
            model.set_attn_implementation("dense_sdpa")
        else:
            cache = dynamic_cache(B, n)
            model.set_attn_implementation("sdpa")
        tok = torch.randint(0, 32000, (B, 1), device="cuda")

        def step(i):
            with torch.no_grad():
                out = model(input_ids=tok, past_key_values=cache, use_cache=True,
                            position_ids=torch.full((B, 1), n + i, device="cuda"),
                            cache_position=torch.tensor([n + i], device="cuda"))
            tok.copy_(out.logits[:, -1:].argmax(-1))
        ms, p90 = time_steps(step, steps)
        used = gpu_used_gib()
        return {"ms_median": ms, "ms_p90": p90, "gpu_used_gib": used}
    except torch.OutOfMemoryError:
        return None
    finally:
        cache = None
        torch.cuda.empty_cache()


def dense_largest(model, kind, n, steps, max_batch):
    """The largest batch whose cache and decode step fit (from the bytes free, then down)."""
    free, _ = torch.cuda.mem_get_info()
    per_seq = L * 2 * H * (n + steps + 1) * D * 2
    B = min(max_batch, max(1, int(free // per_seq)))
    while B >= 1:
        r = dense_row(model, kind, n, B, steps)
        if r is not None:
            return B, r
        B -= 1
    return 0, None


# --- kvshade ------------------------------------------------------------------------------------

def ingest_random(c, spec, profile, n, seed):
    """A session of n distinct tokens whose K/V are random (keys low-rank plus noise), ingested
    from this GPU layer by layer (same-node path: the daemon reads each layer by CUDA IPC)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, 2 ** 30, (n,), generator=g, device="cuda").tolist()
    created = c.create_session(spec, profile, ids)
    with c.ingest(created.session_id, "bf16") as ing:
        for li in range(L):
            lat = torch.randn(n, 64, generator=g, device="cuda", dtype=torch.bfloat16)
            mix = torch.randn(64, H * D, generator=g, device="cuda", dtype=torch.bfloat16) / 8
            k = (lat @ mix).reshape(n, H, D)
            k += 0.1 * torch.randn(n, H, D, generator=g, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(n, H, D, generator=g, device="cuda", dtype=torch.bfloat16)
            ing.layer_cuda(li, k, v)
            try:
                ing.release_taken(max_held_bytes=2 * GIB)
            except kvshade.errors.FailedPrecondition:
                ing.commit()  # the daemon ended the stream: its commit raises why (e.g. no memory)
                raise
        ing.commit()
    return created.session_id


def kvshade_rows(c, model, n, steps, max_batch, time_limit_s, budget, kivi_group=0, daemon_pid=None):
    from kvshade.integrations import hf_cache, serving
    from kvshade.integrations.hf_cache import model_spec_from_config, _text_config, find_rotary_embedding
    hf_cache.enable(model)
    spec = model_spec_from_config(_text_config(model.config), "bench/capacity-%d" % n, find_rotary_embedding(model))
    # value_codec: the server default (auto); kivi_group 0: the server default (32)
    profile = kvshade.Profile("shadow", sparse_budget=budget, kivi_group=kivi_group)
    cache = serving.BatchCache(c, model, model_id=spec.model_id, local_capacity=64)
    sessions, ingest_s, why = [], [], "max_batch"
    t_start = time.perf_counter()
    rows = {}

    def decode_at(B):
        tok = torch.randint(0, 32000, (B,), device="cuda")

        def step(i):
            tok.copy_(cache.decode(model, tok).argmax(-1))
        return time_steps(step, steps)

    try:
        while len(sessions) < max_batch:
            if time.perf_counter() - t_start > time_limit_s:
                why = "time limit"
                break
            t0 = time.perf_counter()
            try:
                sid = ingest_random(c, spec, profile, n, 1000 + len(sessions))
            except (kvshade.errors.KvShadeError, torch.OutOfMemoryError) as e:
                why = "ingest: %s: %s" % (type(e).__name__, str(e).splitlines()[0][:160])
                break
            ingest_s.append(time.perf_counter() - t0)
            try:
                cache.join(sid)
                sessions.append(sid)
                if len(sessions) == 1:
                    ms, p90 = decode_at(1)
                    rows["batch1"] = {"batch": 1, "ms_median": ms, "ms_p90": p90}
                    print(f"  kvshade {n} x1: {ms:.2f} ms/step")
                if len(sessions) % 4 == 0:
                    # One step at the new batch: the decoder's memory for it fits (each probe
                    # adds a token to every tail; the timed steps stay inside local_capacity).
                    cache.decode(model, torch.zeros(len(sessions), dtype=torch.long))
            except (kvshade.errors.ResourceExhausted, torch.OutOfMemoryError) as e:
                why = "decode: %s" % str(e).splitlines()[0][:160]
                if sid in cache.session_ids:
                    cache.leave(sid)
                c.close_session(sid)
                torch.cuda.empty_cache()
                break
        B = len(sessions)
        st = c.stats()
        by_pid = gpu_by_process()
        ms = p90 = None  # no session fitted at all
        while B >= 1:
            try:
                ms, p90 = decode_at(B)
                break
            except (kvshade.errors.ResourceExhausted, torch.OutOfMemoryError) as e:
                why += "; decode at %d: %s" % (B, str(e).splitlines()[0][:120])
                cache.leave(B - 1, close_session=True)
                torch.cuda.empty_cache()
                B -= 1
        rows["largest"] = {"batch": B, "ms_median": ms, "ms_p90": p90, "stopped_by": why,
                           "gpu_used_gib": gpu_used_gib(), "worker_reserved_gib": torch.cuda.memory_reserved() / GIB,
                           "daemon_device_bytes_used_gib": st["device_bytes_used"] / GIB,
                           # what the daemon's device tier holds (its growth steps), used or not
                           "daemon_device_bytes_held_gib": sum(d["device_bytes_held"] for d in c.device_stats()) / GIB,
                           "gpu_by_process_gib": {"daemon": by_pid.get(daemon_pid), "runtime": by_pid.get(os.getpid())},
                           "daemon_host_bytes_used_gib": st["host_bytes_used"] / GIB,
                           "ingest_s_median": statistics.median(ingest_s) if ingest_s else None}
    finally:
        cache.close(close_sessions=True)
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--tokens", default="131072")
    ap.add_argument("--configs", default="prealloc,dynamic,kvshade")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--budget", type=int, default=256, help="kvshade sparse_budget (chunks per KV head)")
    ap.add_argument("--kvshade-time-limit", type=float, default=240.0,
                    help="seconds of ingest before kvshade's batch stops growing")
    ap.add_argument("--kivi-group", type=int, default=0,
                    help="kvshade's value quantization group (tokens' channels per scale); 0: the server default")
    ap.add_argument("--device-budget", default="120GiB")
    ap.add_argument("--host-budget", default="100GiB")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    configs = args.configs.split(",")
    lengths = [int(x) for x in args.tokens.split(",")]
    model = build_model(max(lengths) + 1024)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "model_gib": sum(p.numel() * p.element_size() for p in model.parameters()) / GIB, "rows": []}
    proc = c = None
    if "kvshade" in configs:
        proc, c, log = start_server(args.server, ["--device-budget", args.device_budget, "--host-budget",
                                                  args.host_budget, "--max-message-bytes", "512MiB"])
    try:
        for n in lengths:
            for kind in [k for k in configs if k in ("prealloc", "dynamic")]:
                name = {"prealloc": "dense prealloc + SDPA", "dynamic": "DynamicCache + SDPA"}[kind]
                one = dense_row(model, kind, n, 1, args.steps)
                B, big = dense_largest(model, kind, n, args.steps, args.max_batch)
                row = {"config": name, "tokens": n, "batch1_ms": one and one["ms_median"], "largest_batch": B,
                       "largest_ms": big and big["ms_median"], "largest_p90_ms": big and big["ms_p90"],
                       "tokens_per_s": big and B * 1e3 / big["ms_median"], "gpu_used_gib": big and big["gpu_used_gib"]}
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
            if "kvshade" in configs:
                r = kvshade_rows(c, model, n, args.steps, args.max_batch, args.kvshade_time_limit, args.budget,
                                args.kivi_group, daemon_pid=proc.pid)
                big = r.get("largest", {})
                row = {"config": "kvshade", "tokens": n, "kivi_group": args.kivi_group or None, "batch1_ms": r.get("batch1", {}).get("ms_median"),
                       "largest_batch": big.get("batch"), "largest_ms": big.get("ms_median"),
                       "largest_p90_ms": big.get("ms_p90"),
                       "tokens_per_s": big["batch"] * 1e3 / big["ms_median"] if big.get("ms_median") else None,
                       "gpu_used_gib": big.get("gpu_used_gib"), "detail": big}
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
