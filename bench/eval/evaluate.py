#!/usr/bin/env python3
"""Selection-fidelity harness: decodes the evaluation tasks (tasks.py) with a model whose
prompt cache is held by kvshade (through the public Python package: kvshade.Client and
kvshade.torch_hook.KvShadeKVCache) and compares the answers with full attention and with
the oracle chunk choice at the same budget.

For each sample the model prefills the prompt minus its last token with full attention
(as a serving runtime does); the pre-RoPE keys and values of every layer are ingested into
a kvshade session of the profile under test; then the last prompt token and the answer
are decoded greedily one token at a time, each layer's attention coming from:

  full     the model's own dense cache (local)
  oracle   sink chunk + the k chunks of highest true max logit (over the chunk's tokens and
           the KV head's query heads) + the exact tail + the decoded tokens (local, exact
           keys and values); k = budget
  exact / shadow / mini   kvshade: KvShadeKVCache.attend (static set, select deltas, tail,
           decoded tokens), one session per sample and profile
  shadow, option rpc / rpc-spec   the same shadow session (bf16 values) decoded by
           kvshade.remote.RemoteDecoder, the data-path worker: synchronous selection, or
           speculate-and-correct (each layer attends over the chunks selected with the
           previous step's query unless the query drifted below --correct-below)

A budget of p % is k = max(1, round(p/100 * chunks)) chunks per KV head (sparse_budget for
shadow, mini_heavy_ratio = p/100 for mini). recall@k (shadow): at every decode step, layer
and KV head, |chunks kvshade selected ∩ the oracle's top-k| / k, the oracle ranking the
chunks kvshade could select (not the sink, the session's outlier chunks or the tail).

  python3 bench/eval/evaluate.py --weights bench/eval/weights/evallm.pt --spawn build/service/kvshade-server
  python3 bench/eval/evaluate.py --hf /path/to/hf-model --target 127.0.0.1:50551

Writes --out-json (every sample and config, and the summary) and --out-md (the table).
"""
import argparse
import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))
import tasks as T  # noqa: E402
from model import HFBackbone, OwnBackbone, load  # noqa: E402

CHUNK = T.CHUNK


# --- Oracle and recall (pure functions; tests/python/test_eval_bench.py checks them) -------

def chunk_max_logits(q, k_post, n_chunks, chunk=CHUNK):
    """q [hq, d], k_post [n, h, d] -> [h, n_chunks]: per KV head and chunk, the maximum over
    the chunk's tokens and the head's query heads of q.k / sqrt(d)."""
    hq, d = q.shape
    h = k_post.shape[1]
    g = hq // h
    kk = k_post[:n_chunks * chunk].float()                               # [t, h, d]
    s = torch.einsum("hgd,thd->htg", q.float().reshape(h, g, d), kk) / math.sqrt(d)
    return s.reshape(h, n_chunks, chunk * g).amax(-1)


def oracle_topk(scores, k, exclude=None):
    """scores [h, c]; exclude: per head a set of chunk ids not eligible. -> list (per head) of
    the k best chunk ids (ties to the lower id), as python sets."""
    out = []
    for j in range(scores.shape[0]):
        s = scores[j].clone()
        if exclude is not None and len(exclude[j]):
            s[torch.as_tensor(sorted(exclude[j]), dtype=torch.long)] = float("-inf")
        kk = min(k, int(torch.isfinite(s).sum()))
        order = torch.sort(s, descending=True, stable=True).indices[:kk].tolist()   # ties: lower id
        out.append(set(int(i) for i in order))
    return out


def recall_at_k(selected, oracle, k):
    """selected, oracle: per head sets of chunk ids -> mean over heads of |sel ∩ oracle| / k."""
    if k <= 0:
        return float("nan")
    return float(np.mean([len(s & o) / float(min(k, max(len(o), 1))) for s, o in zip(selected, oracle)]))


def match_static_chunks(static_k, lengths, k_post, chunk=CHUNK):
    """Static set rows (post-RoPE keys [h, s_max, d], lengths [h]) -> per head the set of
    chunk ids whose tokens they are (nearest key among the prompt's tokens)."""
    out = []
    for j in range(static_k.shape[0]):
        n = int(lengths[j]) if len(lengths) else 0
        if n == 0:
            out.append(set())
            continue
        rows = torch.as_tensor(static_k[j, :n]).float()
        kj = k_post[:, j].float().cpu()
        dist = torch.cdist(rows, kj)
        out.append(set(int(i) // chunk for i in dist.argmin(-1).tolist()))
    return out


# --- Attention providers --------------------------------------------------------------------

def attend_tokens(q, keys, values):
    """q [hq, d]; keys, values [h, t, d] (t may differ per head: lists) -> [hq, d] float32."""
    hq, d = q.shape
    h = len(keys)
    g = hq // h
    out = torch.empty(hq, d, dtype=torch.float32, device=q.device)
    for j in range(h):
        s = (q[j * g:(j + 1) * g].float() @ keys[j].float().T) / math.sqrt(d)
        out[j * g:(j + 1) * g] = torch.softmax(s, -1) @ values[j].float()
    return out


class LocalAttend:
    """Full attention over the prefill cache plus decoded tokens, or (budget k) the oracle:
    sink chunk + top-k chunks by true max logit + the tail + decoded tokens."""

    def __init__(self, pf, budget=None, local_window=32, chunk=CHUNK):
        self.pf, self.k, self.C = pf, budget, chunk
        n = pf.k_post[0].shape[0]
        self.n_chunks = max(0, (n - local_window) // chunk)
        self.new_k = [[] for _ in pf.k_post]
        self.new_v = [[] for _ in pf.k_post]

    def attend(self, layer, q, k, v):
        self.new_k[layer].append(k)
        self.new_v[layer].append(v)
        kp, vp = self.pf.k_post[layer], self.pf.v[layer]
        nk, nv = torch.stack(self.new_k[layer]), torch.stack(self.new_v[layer])
        h = kp.shape[1]
        if self.k is None:
            keys = [torch.cat([kp[:, j], nk[:, j]]) for j in range(h)]
            vals = [torch.cat([vp[:, j], nv[:, j]]) for j in range(h)]
            return attend_tokens(q, keys, vals)
        C, nc = self.C, self.n_chunks
        scores = chunk_max_logits(q, kp, nc, C)
        top = oracle_topk(scores, self.k, [{0}] * h)
        keys, vals = [], []
        for j in range(h):
            chunks = sorted({0} | top[j])
            idx = torch.cat([torch.arange(c * C, (c + 1) * C) for c in chunks] +
                            [torch.arange(nc * C, kp.shape[0])]).to(kp.device)
            keys.append(torch.cat([kp[idx, j], nk[:, j]]))
            vals.append(torch.cat([vp[idx, j], nv[:, j]]))
        return attend_tokens(q, keys, vals)

    def close(self):
        pass


def kvshade_attend_class():
    from kvshade.torch_hook import KvShadeKVCache

    class TrackedCache(KvShadeKVCache):
        """KvShadeKVCache that also remembers which chunk each slot holds, to measure recall."""

        def reload_static(self):
            super().reload_static()
            m, a = self.model, self.attachment
            self.slot_chunk = [np.full((m.num_kv_heads, max(a.slots_per_head, 1)), -1, np.int64)
                               for _ in range(m.num_layers)]

        def _apply(self, layer, delta):
            super()._apply(layer, delta)
            if len(delta.head):
                self.slot_chunk[layer][delta.head.astype(np.int64), delta.slot.astype(np.int64)] = delta.chunk

    return TrackedCache


class KvShadeAttend:
    """Decode attention through kvshade (KvShadeKVCache) for one sample and profile; for
    shadow sessions, recall@k of each selection against the oracle."""

    def __init__(self, client, spec, profile, pf, prompt_ids, budget, worker_id="eval"):
        self.cache = kvshade_attend_class()(client, spec, profile, worker_id=worker_id)
        self.pf, self.k = pf, budget
        self.cache.prefill(np.asarray(prompt_ids, np.int64), [t.cpu() for t in pf.k_pre],
                           [t.cpu() for t in pf.v], [t.cpu() for t in pf.q_obs])
        self.kind = self.cache.effective_profile
        self.recalls = []
        self._static_chunks = {}
        self._nc = {}

    def _k_cpu(self, layer):
        if not hasattr(self.pf, "k_post_cpu"):
            self.pf.k_post_cpu = [t.cpu() for t in self.pf.k_post]
        return self.pf.k_post_cpu[layer]

    def _static(self, layer):
        if layer not in self._static_chunks:
            st = self.cache._static[layer]
            kp = self._k_cpu(layer)
            self._nc[layer] = (kp.shape[0] - st.tail_k.shape[0]) // self.cache.attachment.chunk_size
            self._static_chunks[layer] = match_static_chunks(st.k, st.lengths, kp, self.cache.attachment.chunk_size)
        return self._static_chunks[layer], self._nc[layer]

    def attend(self, layer, q, k, v):
        out = self.cache.attend(layer, q, k, v)
        if self.kind == "shadow" and self.k:
            static, nc = self._static(layer)
            C = self.cache.attachment.chunk_size
            scores = chunk_max_logits(q.cpu(), self._k_cpu(layer), nc, C)
            top = oracle_topk(scores, self.k, [s | {0} for s in static])
            sel = [set(int(c) for c in row if c >= 0) for row in self.cache.slot_chunk[layer]]
            self.recalls.append(recall_at_k(sel, top, self.k))
        return out

    def close(self):
        self.cache.close(close_session=True)


class RemoteAttend:
    """Decode attention through kvshade.remote.RemoteDecoder (the worker of the data path)
    for one sample: synchronous selection, or speculate-and-correct."""

    def __init__(self, client, spec, profile, pf, prompt_ids, device, speculate, correct_below, worker_id="eval"):
        from kvshade.remote import RemoteDecoder
        from kvshade.torch_hook import KvShadeKVCache
        self.cache = KvShadeKVCache(client, spec, profile, worker_id=worker_id)
        self.cache.prefill(np.asarray(prompt_ids, np.int64), [t.cpu() for t in pf.k_pre],
                           [t.cpu() for t in pf.v], [t.cpu() for t in pf.q_obs], attach=False)
        try:
            self.dec = RemoteDecoder(client, [self.cache.session_id], spec, device=device, worker_id=worker_id,
                                     speculate=speculate, correct_below=correct_below)
        except BaseException:
            self.cache.close(close_session=True)
            raise

    def attend(self, layer, q, k, v):
        return self.dec.attend(layer, q[None], k[None], v[None])[0]

    def stats(self):
        st = self.dec.stats()
        return {key: st[key] for key in ("speculated", "corrections", "speculated_heads", "corrected_heads")
                if key in st}

    def close(self):
        try:
            self.dec.close()
        finally:
            self.cache.close(close_session=True)


REMOTE_OPTIONS = {"rpc": False, "rpc-spec": True}   # option name -> RemoteDecoder(speculate=)


# --- Configurations ---------------------------------------------------------------------------

def profile_fields():
    import kvshade
    return {f.name for f in dataclasses.fields(kvshade.Profile)}


def build_configs(a, n_chunks, n_tokens):
    """[(name, kind, budget_pct, k, option, profile kwargs or None)]"""
    budgets = [float(b) for b in a.budgets.split(",")]
    kb = {b: max(1, int(round(b / 100.0 * n_chunks))) for b in budgets}
    base = dict(rank=a.rank, chunk_size=CHUNK, outliers=a.outliers, keep_sink=True, local_window=a.local_window)
    out = []
    want = set(a.configs.split(","))
    if "full" in want:
        out.append(("full", "full", None, None, "-", None))
    if "oracle" in want:
        out += [("oracle", "oracle", b, kb[b], "-", None) for b in budgets]
    if "exact" in want:
        out.append(("exact", "exact", None, None, "-", dict(kind="exact")))
    options = [("bf16", dict(value_codec="bf16"))]
    if "int4" in a.codecs.split(","):
        options.append(("int4", dict(value_codec="int4")))
    fields = profile_fields()
    shadow_options = list(a.shadow_option)
    if a.auto_options:   # the selection options of kvshade.Profile, where this version has them
        if "rerank_factor" in fields:
            shadow_options.append("rerank4:rerank_factor=4")
        if "mass_top_p" in fields:
            shadow_options.append("top_p0.9:mass_top_p=0.9" + (",mass_min_chunks=4" if "mass_min_chunks" in fields else ""))
    for spec in shadow_options:
        name, _, kv = spec.partition(":")
        extra = {}
        for item in filter(None, kv.split(",")):
            key, _, val = item.partition("=")
            if key not in fields:
                raise SystemExit("--shadow-option %s: kvshade.Profile has no field %r (fields: %s)" %
                                 (spec, key, ", ".join(sorted(fields))))
            try:
                extra[key] = int(val)
            except ValueError:
                try:
                    extra[key] = float(val)
                except ValueError:
                    extra[key] = val
        options.append((name, dict(value_codec="bf16", **extra)))
    for dec in filter(None, a.decoders.split(",")):
        if dec not in REMOTE_OPTIONS:
            raise SystemExit("--decoders: unknown decoder %r (known: %s)" % (dec, ", ".join(REMOTE_OPTIONS)))
        options.append((dec, dict(value_codec="bf16")))
    if "shadow" in want:
        for opt, kw in options:
            out += [("shadow", "shadow", b, kb[b], opt, dict(kind="shadow", sparse_budget=kb[b], **base, **kw))
                    for b in budgets]
    if "mini" in want:
        recent = max(a.local_window / float(n_tokens), 1e-4)
        out += [("mini", "mini", b, None, "bf16", dict(kind="mini", mini_recent_ratio=recent,
                                                       mini_heavy_ratio=b / 100.0)) for b in budgets]
    return out


# --- Server -----------------------------------------------------------------------------------

class SpawnedServer:
    def __init__(self, binary, backend, extra=()):
        self.dir = tempfile.mkdtemp(prefix="kvshade-eval-")
        port_file = os.path.join(self.dir, "port")
        self.log_path = os.path.join(self.dir, "server.log")
        self._log = open(self.log_path, "wb")
        env = dict(os.environ, OMP_WAIT_POLICY="passive")
        self.proc = subprocess.Popen([binary, "--listen", "127.0.0.1:0", "--port-file", port_file,
                                      "--backend", backend] + list(extra),
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        end = time.time() + 60
        while not os.path.exists(port_file) or not open(port_file).read().strip():
            if self.proc.poll() is not None or time.time() > end:
                raise RuntimeError("kvshade-server did not start:\n" + open(self.log_path).read())
            time.sleep(0.02)
        self.target = "127.0.0.1:" + open(port_file).read().strip()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# --- Evaluation -------------------------------------------------------------------------------

def decode(backbone, prompt, n_new, attend):
    """Greedy: the last prompt token, then n_new - 1 generated ones; returns the n_new ids."""
    tok, pos, out = int(prompt[-1]), len(prompt) - 1, []
    for _ in range(n_new):
        logits = backbone.step(tok, pos, attend.attend)
        tok = int(logits.argmax())
        out.append(tok)
        pos += 1
    return out


def summarize(rows):
    cells = defaultdict(lambda: [0, 0, 0.0, 0, 0, 0])   # correct, n, recall sum, recall n, agree, agree n
    for r in rows:
        key = (r["config"], r["budget_pct"], r["option"], r["task"], r["locality"])
        c = cells[key]
        c[0] += r["correct"]
        c[1] += 1
        if r["recall"] is not None:
            c[2] += r["recall"]
            c[3] += 1
        if r.get("agrees_full") is not None:
            c[4] += r["agrees_full"]
            c[5] += 1
    out = []
    for (cfg, b, opt, task, loc), (ok, n, rs, rn, ag, an) in sorted(cells.items(), key=lambda kv: str(kv[0])):
        out.append(dict(config=cfg, budget_pct=b, option=opt, task=task, locality=loc, n=n,
                        accuracy=100.0 * ok / n, recall=(rs / rn if rn else None),
                        agrees_full=(100.0 * ag / an if an else None)))
    return out


def markdown(summary, cell_order, title=""):
    by = defaultdict(dict)
    rec = defaultdict(list)
    agree = defaultdict(list)
    for s in summary:
        if s.get("agrees_full") is not None:
            agree[(s["config"], s["budget_pct"], s["option"])].append(s["agrees_full"])
        key = (s["config"], s["budget_pct"], s["option"])
        by[key][(s["task"], s["locality"])] = s
        if s["recall"] is not None:
            rec[key].append(s["recall"])
    cols = ["%s/%s" % (t, "loc" if l else "noloc") for t, l in cell_order]
    lines = []
    if title:
        lines.append(title)
        lines.append("")
    lines.append("| config | budget | option | " + " | ".join(cols) + " | mean | % of oracle | = full | recall@k |")
    lines.append("|" + "---|" * (len(cols) + 7))
    order = {"full": 0, "exact": 1, "oracle": 2, "shadow": 3, "mini": 4}
    means = {}
    for key in by:
        vals = [by[key][c]["accuracy"] for c in cell_order if c in by[key]]
        means[key] = sum(vals) / len(vals) if vals else float("nan")
    for key in sorted(by, key=lambda k: (order.get(k[0], 9), -1 if k[1] is None else k[1], k[2])):
        cfg, b, opt = key
        vals = [("%.1f" % by[key][c]["accuracy"]) if c in by[key] else "-" for c in cell_order]
        orc = means.get(("oracle", b, "-"))
        vs = "%.0f%%" % (100.0 * means[key] / orc) if (orc and cfg not in ("oracle",) and b is not None) else "-"
        r = "%.3f" % (sum(rec[key]) / len(rec[key])) if rec[key] else "-"
        ag = "%.1f" % (sum(agree[key]) / len(agree[key])) if agree[key] and cfg != "full" else "-"
        lines.append("| %s | %s | %s | %s | %.1f | %s | %s | %s |" % (
            cfg, "-" if b is None else "%g%%" % b, opt, " | ".join(vals), means[key], vs, ag, r))
    return "\n".join(lines) + "\n"


def speculation_note(rows):
    """Per budget: rpc-spec against rpc (the same selection, synchronous) on the same samples:
    accuracy of each, % of samples decoded identically, and the corrections' share."""
    sync = {(r["sample"], r["budget_pct"]): r for r in rows if r["option"] == "rpc"}
    lines = []
    for b in sorted({r["budget_pct"] for r in rows if r["option"] == "rpc-spec"}):
        spec = [r for r in rows if r["option"] == "rpc-spec" and r["budget_pct"] == b
                and (r["sample"], b) in sync]
        if not spec:
            continue
        same = sum(r["generated"] == sync[(r["sample"], b)]["generated"] for r in spec)
        acc_s = 100.0 * sum(r["correct"] for r in spec) / len(spec)
        acc_y = 100.0 * sum(sync[(r["sample"], b)]["correct"] for r in spec) / len(spec)
        spec_n = sum(r.get("speculated", 0) for r in spec)
        corr = sum(r.get("corrections", 0) for r in spec)
        hs = sum(r.get("speculated_heads", 0) for r in spec)
        hc = sum(r.get("corrected_heads", 0) for r in spec)
        lines.append("| %g%% | %d | %.1f | %.1f | %+.1f | %.1f | %d / %d (%.1f%%) | %s |" % (
            b, len(spec), acc_y, acc_s, acc_s - acc_y, 100.0 * same / len(spec), corr, spec_n + corr,
            100.0 * corr / max(spec_n + corr, 1),
            "%d / %d (%.1f%%)" % (hc, hs + hc, 100.0 * hc / (hs + hc)) if hs + hc else "-"))
    if not lines:
        return ""
    return ("\nSpeculate-and-correct (rpc-spec) against synchronous selection (rpc), same samples:\n\n"
            "| budget | samples | rpc accuracy | rpc-spec accuracy | delta (points) | decoded identically % "
            "| corrected sequence-layers | corrected KV heads |\n|---|---|---|---|---|---|---|---|\n"
            + "\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--weights", help="EvalLM weights (train.py)")
    src.add_argument("--hf", help="a Hugging Face model directory (Llama-style)")
    srv = ap.add_mutually_exclusive_group(required=True)
    srv.add_argument("--target", help="a running kvshade-server")
    srv.add_argument("--spawn", help="start this kvshade-server binary on a free loopback port")
    ap.add_argument("--backend", default=None, help="for --spawn: cpu or cuda (default: cuda when torch sees a GPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--length", type=int, default=8192, help="prompt tokens (synthetic tokens; HF: before tokenization)")
    ap.add_argument("--per-cell", type=int, default=8, help="samples per (task, locality)")
    ap.add_argument("--seed", type=int, default=20261201)
    ap.add_argument("--tasks", default="mk,vt,fw")
    ap.add_argument("--budgets", default="1.5,3,6", help="percent of the prompt's chunks")
    ap.add_argument("--configs", default="full,oracle,exact,shadow,mini")
    ap.add_argument("--codecs", default="bf16,int4", help="shadow value codecs")
    ap.add_argument("--shadow-option", action="append", default=[],
                    help="NAME:field=value,... another shadow variant (fields of kvshade.Profile), at every budget")
    ap.add_argument("--no-auto-options", dest="auto_options", action="store_false",
                    help="do not add the shadow variants kvshade.Profile offers (rerank_factor 4: two-stage "
                         "selection; mass_top_p 0.9 with mass_min_chunks 4: budgets by attention mass)")
    ap.add_argument("--decoders", default="rpc,rpc-spec",
                    help="shadow (bf16) also decoded by kvshade.remote.RemoteDecoder: rpc (synchronous), rpc-spec "
                         "(speculate-and-correct); empty for none")
    ap.add_argument("--correct-below", type=float, default=0.9, help="rpc-spec: RemoteDecoder correct_below")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--outliers", type=int, default=2)
    ap.add_argument("--local-window", type=int, default=32)
    ap.add_argument("--out-json", default="selection_fidelity.json")
    ap.add_argument("--out-md", default="selection_fidelity.md")
    ap.add_argument("--time-limit-s", type=float, default=0, help="stop taking new samples after this long (0: none)")
    a = ap.parse_args(argv)

    if a.spawn and not os.environ.get("KVSHADE_LIB"):
        # The C library of the same build as the server (build/service/.. -> build/client/).
        lib = os.path.join(os.path.dirname(os.path.abspath(a.spawn)), "..", "client", "libkvshade.so")
        if os.path.exists(lib):
            os.environ["KVSHADE_LIB"] = os.path.normpath(lib)
    import kvshade
    dev = torch.device(a.device)
    if a.weights:
        m, meta = load(a.weights, "cpu")
        backbone = OwnBackbone(m, dev)
        with open(a.weights, "rb") as f:
            model_id = "evallm-" + hashlib.sha256(f.read()).hexdigest()[:16]
        src_name = a.weights
    else:
        backbone = HFBackbone(a.hf, dev)
        model_id = "eval-" + os.path.basename(os.path.normpath(a.hf))
        meta, src_name = {}, a.hf
    spec = backbone.spec(model_id)
    server = None
    if a.spawn:
        backend = a.backend or ("cuda" if torch.cuda.is_available() else "cpu")
        server = SpawnedServer(a.spawn, backend)
        target = server.target
    else:
        target = a.target
    cells = T.eval_set(a.seed, T.TaskConfig(), a.length, a.per_cell, tasks=tuple(a.tasks.split(",")))
    n_cells = len(cells) // a.per_cell
    # Round robin over the cells, so that a time limit leaves them balanced.
    samples = [cells[c * a.per_cell + i] for i in range(a.per_cell) for c in range(n_cells)]
    rows, t0 = [], time.time()
    timing = defaultdict(float)
    try:
        with kvshade.Client(target) as client:
            client.wait_ready(30)
            for si, s in enumerate(samples):
                if a.time_limit_s and time.time() - t0 > a.time_limit_s:
                    print("time limit: stopped after %d of %d samples" % (si, len(samples)), flush=True)
                    break
                ids = backbone.encode(s.prompt)
                if a.hf:
                    ans_ids = backbone.tok(" " + T.render_text(s.answer), add_special_tokens=False).input_ids
                    n_new = len(ans_ids) + 1
                else:
                    n_new = len(s.answer)
                ids_np = np.asarray(ids, np.int64)
                pf = backbone.prefill(ids_np[:-1])
                n_ing = len(ids_np) - 1
                configs = build_configs(a, n_ing // CHUNK, n_ing)
                full_gen = None
                for name, kind, b, k, opt, prof in configs:
                    t1 = time.time()
                    if prof is None:
                        att = LocalAttend(pf, k, a.local_window)
                    elif opt in REMOTE_OPTIONS:
                        att = RemoteAttend(client, spec, kvshade.Profile(**prof), pf, ids_np[:-1], dev,
                                           REMOTE_OPTIONS[opt], a.correct_below, worker_id="eval-%d" % si)
                    else:
                        att = KvShadeAttend(client, spec, kvshade.Profile(**prof), pf, ids_np[:-1], k,
                                            worker_id="eval-%d" % si)
                    try:
                        gen = decode(backbone, ids_np, n_new, att)
                    finally:
                        att.close()
                    if a.hf:
                        words = backbone.tok.decode(gen).split()
                        want = [T.word_text(int(t)) for t in s.answer]
                        ok = words[:len(want)] == want
                    else:
                        ok = gen == [int(t) for t in s.answer]
                    if name == "full":
                        full_gen = list(gen)
                    rec = getattr(att, "recalls", None)
                    extra = att.stats() if hasattr(att, "stats") else {}
                    rows.append(dict(**extra,sample=si, task=s.task, locality=s.locality, config=name, budget_pct=b,
                                     k=k, option=opt, correct=int(ok), generated=[int(t) for t in gen],
                                     agrees_full=(None if full_gen is None else int(gen == full_gen)),
                                     answer=[int(t) for t in s.answer],
                                     recall=(float(np.mean(rec)) if rec else None)))
                    timing[(name, opt)] += time.time() - t1
                if si % 6 == 5:
                    print("%d/%d samples, %.0f s" % (si + 1, len(samples), time.time() - t0), flush=True)
    finally:
        if server:
            server.stop()
    summary = summarize(rows)
    cell_order = [(t, l) for t in a.tasks.split(",") for l in (True, False)]
    title = ("Selection fidelity: %s, %d-token prompts, %d samples per cell, rank %d, %d outliers, local %d, "
             "C %d; accuracy %% (exact match of the answer); = full: %% of samples decoded exactly as with full "
             "attention" % (
                 os.path.basename(src_name), a.length, a.per_cell, a.rank, a.outliers, a.local_window, CHUNK))
    md = markdown(summary, cell_order, title) + speculation_note(rows)
    print(md)
    elapsed = time.time() - t0
    with open(a.out_md, "w") as f:
        f.write(md)
    with open(a.out_json, "w") as f:
        json.dump(dict(args=vars(a), model_meta=meta, model_id=model_id, seconds=round(elapsed, 1),
                       seconds_by_config={"%s/%s" % k: round(v, 2) for k, v in timing.items()},
                       summary=summary, rows=rows), f, indent=1)
    print("evaluated %d samples in %.0f s -> %s, %s" % (len({r['sample'] for r in rows}), elapsed, a.out_md, a.out_json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
