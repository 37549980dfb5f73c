#!/usr/bin/env python3
"""Selection-fidelity harness: decodes the evaluation tasks (tasks.py) with a model whose
prompt cache is held by kvshade (through the public Python package: kvshade.Client and
kvshade.integrations.torch_hook.KvShadeKVCache) and compares the answers with full attention and with
the oracle chunk choice at the same budget.

For each sample the model prefills the prompt minus its last token with full attention
(as a serving runtime does); the pre-RoPE keys and values of every layer are ingested into
a kvshade session of the profile under test; then the last prompt token and the answer
are decoded greedily one token at a time, each layer's attention coming from:

  full     the model's own dense cache (local)
  oracle   sink chunk + the k best chunks by exact keys (--oracle-score softmax, the default:
           the maximum over the chunk's tokens and the KV head's query heads of each query
           head's attention probability over the prompt; max-logit: of the raw logit) + the
           exact tail + the decoded tokens (local, exact keys and values); k = budget
  exact / shadow / mini   kvshade: KvShadeKVCache.attend (static set, select deltas, tail,
           decoded tokens), one session per sample and profile
  shadow, option rpc / rpc-spec   the same shadow session (bf16 values) decoded by
           kvshade.decoders.remote.RemoteDecoder, the data-path worker: synchronous selection, or
           speculate-and-correct (each layer attends over the chunks selected with the
           previous step's query unless the query drifted below --correct-below)

A budget of p % is k = max(1, round(p/100 * chunks)) chunks per KV head (sparse_budget for
shadow, mini_heavy_ratio = p/100 for mini). recall@k (shadow): at every decode step, layer
and KV head, |chunks kvshade selected ∩ the oracle's top-k| / k, the oracle ranking the
chunks kvshade could select (not the sink, the session's outlier chunks or the tail; a
session that selects units of u tokens: its units against the oracle's top k*C/u units);
reported as the mean and per layer, worst layer first (a single layer that misses its
chunks loses the answer however well the others do). Mass recall (shadow), beside it: the
attention probability (each query head's softmax over the prompt, summed over the KV head's
query heads) in the selected chunks over that in the oracle's top k; it tells a layer whose
misses are near-ties of a thinly spread attention from one that loses what it attends. Selection cost: seconds per decode
step (all layers) spent in Client.select and in the whole attention call of each config.

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

def group_logits(q, k_post):
    """q [hq, d], k_post [n, h, d] -> [h, g, n]: q.k / sqrt(d) of each KV head's g query heads."""
    hq, d = q.shape
    h = k_post.shape[1]
    return torch.einsum("hgd,thd->hgt", q.float().reshape(h, hq // h, d), k_post.float()) / math.sqrt(d)


def chunk_max_logits(q, k_post, n_chunks, chunk=CHUNK, logits=None):
    """q [hq, d], k_post [n, h, d] -> [h, n_chunks]: per KV head and chunk, the maximum over
    the chunk's tokens and the head's query heads of q.k / sqrt(d). logits: group_logits(q,
    k_post) when the caller has it (every score below takes it alike)."""
    s = (group_logits(q, k_post) if logits is None else logits)[:, :, :n_chunks * chunk]
    return s.reshape(s.shape[0], s.shape[1], n_chunks, chunk).amax(-1).amax(1)


def chunk_softmax_max(q, k_post, n_chunks, chunk=CHUNK, logits=None):
    """q [hq, d], k_post [n, h, d] -> [h, n_chunks]: per KV head and chunk, the maximum over the
    chunk's tokens and the head's query heads of log p_n(t), p_n the query head's softmax over
    every prompt token in k_post. Each query head is normalised before the group's maximum,
    as two-stage selection's stage 2 and the recall guard rank (docs/ALGORITHM.md "Selection
    options"): a query head with large logits everywhere does not decide alone."""
    s = group_logits(q, k_post) if logits is None else logits
    logp = (s - torch.logsumexp(s, dim=-1, keepdim=True))[:, :, :n_chunks * chunk]
    return logp.reshape(s.shape[0], s.shape[1], n_chunks, chunk).amax(-1).amax(1)


ORACLE_SCORES = {"softmax": chunk_softmax_max, "max-logit": chunk_max_logits}


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


def unit_mass(q, k_post, n_units, unit=CHUNK, logits=None):
    """q [hq, d], k_post [n, h, d] -> [h, g, n_units]: each query head's attention probability
    (softmax over every prompt token in k_post) summed over each unit's tokens."""
    s = group_logits(q, k_post) if logits is None else logits
    p = torch.softmax(s, dim=-1)[:, :, :n_units * unit]
    return p.reshape(s.shape[0], s.shape[1], n_units, unit).sum(-1)


def mass_recall(selected, oracle, mass):
    """selected, oracle: per KV head sets of unit ids; mass [h, g, units] (unit_mass) -> mean
    over KV heads of the attention mass (summed over the head's query heads) in the selected
    units over the mass in the oracle's. Where the oracle's k units hold most of the mass this
    is close to recall@k; where the mass is spread thin (near-ties decide the oracle's top k) it
    says how much of what the oracle keeps the selection keeps (it may exceed 1: the oracle
    ranks by the group's maximum, not by its sum)."""
    out = []
    for j, (s, o) in enumerate(zip(selected, oracle)):
        den = float(mass[j, :, sorted(o)].sum()) if o else 0.0
        if den > 0:
            num = float(mass[j, :, sorted(s)].sum()) if s else 0.0
            out.append(num / den)
    return float(np.mean(out)) if out else float("nan")


def recall_at_k(selected, oracle, k):
    """selected, oracle: per head sets of chunk ids -> mean over heads of |sel ∩ oracle| / k."""
    if k <= 0:
        return float("nan")
    return float(np.mean([len(s & o) / float(min(k, max(len(o), 1))) for s, o in zip(selected, oracle)]))


def mean_by_layer(per_sample):
    """Per-sample lists of per-layer recall (None where a layer has none) -> per layer the
    mean over the samples that have it (None where none has)."""
    n = max((len(r) for r in per_sample), default=0)
    out = []
    for layer in range(n):
        vals = [r[layer] for r in per_sample if layer < len(r) and r[layer] is not None and r[layer] == r[layer]]
        out.append(float(np.mean(vals)) if vals else None)
    return out


def layers_worst_first(per_layer):
    """Per-layer recall (list, None for none) -> [(layer, recall)], worst first (ties: lower layer)."""
    return sorted(((i, float(r)) for i, r in enumerate(per_layer) if r is not None and r == r),
                  key=lambda lr: (lr[1], lr[0]))


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
    sink chunk + top-k chunks by the oracle score (exact keys) + the tail + decoded tokens."""

    def __init__(self, pf, budget=None, local_window=32, chunk=CHUNK, score=chunk_softmax_max):
        self.pf, self.k, self.C, self.score = pf, budget, chunk, score
        n = pf.k_post[0].shape[0]
        self.n_chunks = max(0, (n - local_window) // chunk)
        self.new_k = [[] for _ in pf.k_post]
        self.new_v = [[] for _ in pf.k_post]
        self.attend_s = 0.0

    def attend(self, layer, q, k, v):
        t0 = time.perf_counter()
        try:
            out = self._attend(layer, q, k, v)
            sync(out.device)
            return out
        finally:
            self.attend_s += time.perf_counter() - t0

    def _attend(self, layer, q, k, v):
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
        scores = self.score(q, kp, nc, C)
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


class TimedClient:
    """A kvshade.Client as it is, but for the seconds its synchronous select() calls take
    (the RPC: the server's selection and reconstruction of the missed chunks, the deltas'
    transfer), summed in `select_s`."""

    def __init__(self, client):
        self._client = client
        self.select_s = 0.0

    def select(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._client.select(*args, **kwargs)
        finally:
            self.select_s += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._client, name)


def sync(device):
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def kvshade_attend_class():
    from kvshade.integrations.torch_hook import KvShadeKVCache

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

    def __init__(self, client, spec, profile, pf, prompt_ids, budget, worker_id="eval", score=chunk_softmax_max):
        self.client = TimedClient(client)
        self.score = score
        self.cache = kvshade_attend_class()(self.client, spec, profile, worker_id=worker_id)
        self.pf, self.k = pf, budget
        self.cache.prefill(np.asarray(prompt_ids, np.int64), [t.cpu() for t in pf.k_pre],
                           [t.cpu() for t in pf.v], [t.cpu() for t in pf.q_obs])
        self.kind = self.cache.effective_profile
        self.recalls = []
        self.recalls_by_layer = defaultdict(list)
        self.mass_by_layer = defaultdict(list)
        self._static_chunks = {}
        self._nc = {}
        self.attend_s = 0.0

    @property
    def select_s(self):
        return self.client.select_s

    def recall_by_layer(self, mass=False):
        """Per layer the mean recall@k (mass: mass recall) over the decode steps (None for a
        layer without)."""
        n, by = self.cache.model.num_layers, (self.mass_by_layer if mass else self.recalls_by_layer)
        return [float(np.mean(by[i])) if by.get(i) else None for i in range(n)]

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
        t0 = time.perf_counter()
        out = self.cache.attend(layer, q, k, v)
        self.attend_s += time.perf_counter() - t0   # the recall bookkeeping below is not timed
        if self.kind == "shadow" and self.k:
            static, nc = self._static(layer)
            C = self.cache.attachment.chunk_size
            # A session that selects units of u tokens (slot_tokens = u < C) is scored
            # against the oracle of the same unit (its top k*C/u units by the same score),
            # its slots holding unit ids.
            u = self.cache.attachment.slot_tokens or C
            per = C // u if 0 < u < C else 1
            excluded = [set(j for c in (s | {0}) for j in range(c * per, (c + 1) * per)) for s in static]
            qc, kp = q.cpu(), self._k_cpu(layer)
            logits = group_logits(qc, kp)   # the oracle's score and the mass share them
            scores = self.score(qc, kp, nc * per, C // per, logits=logits)
            top = oracle_topk(scores, self.k * per, excluded)
            sel = [set(int(c) for c in row if c >= 0) for row in self.cache.slot_chunk[layer]]
            r = recall_at_k(sel, top, self.k * per)
            self.recalls.append(r)
            self.recalls_by_layer[layer].append(r)
            m = mass_recall(sel, top, unit_mass(qc, kp, nc * per, C // per, logits=logits))
            if m == m:
                self.mass_by_layer[layer].append(m)
        return out

    def close(self):
        self.cache.close(close_session=True)


class RemoteAttend:
    """Decode attention through kvshade.decoders.remote.RemoteDecoder (the worker of the data path)
    for one sample: synchronous selection, or speculate-and-correct."""

    def __init__(self, client, spec, profile, pf, prompt_ids, device, speculate, correct_below, worker_id="eval"):
        from kvshade.decoders.remote import RemoteDecoder
        from kvshade.integrations.torch_hook import KvShadeKVCache
        client = self.client = TimedClient(client)
        self.device, self.attend_s = device, 0.0
        self.cache = KvShadeKVCache(client, spec, profile, worker_id=worker_id)
        self.cache.prefill(np.asarray(prompt_ids, np.int64), [t.cpu() for t in pf.k_pre],
                           [t.cpu() for t in pf.v], [t.cpu() for t in pf.q_obs], attach=False)
        try:
            self.dec = RemoteDecoder(client, [self.cache.session_id], spec, device=device, worker_id=worker_id,
                                     speculate=speculate, correct_below=correct_below)
        except BaseException:
            self.cache.close(close_session=True)
            raise

    @property
    def select_s(self):
        return self.client.select_s

    def attend(self, layer, q, k, v):
        t0 = time.perf_counter()
        out = self.dec.attend(layer, q[None], k[None], v[None])[0]
        sync(self.device)
        self.attend_s += time.perf_counter() - t0
        return out

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

def profile_fields(profile_cls=None):
    """The field names of kvshade.Profile (or profile_cls), read from the dataclass: a field
    the package gains later is an option here without a change."""
    if profile_cls is None:
        import kvshade
        profile_cls = kvshade.Profile
    return {f.name for f in dataclasses.fields(profile_cls)}


HARNESS_FIELDS = ("kind", "sparse_budget")   # set by the harness for every shadow config
MINI_HARNESS_FIELDS = ("kind", "mini_recent_ratio", "mini_heavy_ratio")   # ... and every mini config


def option_value(text):
    """'4' -> 4, '0.9' -> 0.9, 'true'/'false' -> bool, 'none' -> None, else the string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_shadow_option(spec, fields, flag="--shadow-option", harness=HARNESS_FIELDS):
    """'NAME:field=value,...' -> (NAME, {field: value}); fields: kvshade.Profile's names
    (profile_fields()). kind and sparse_budget are the harness's (the budget is swept); for
    --mini-option, kind and the two mini ratios."""
    name, sep, kv = spec.partition(":")
    if not name or not sep:
        raise SystemExit("%s %r: expected NAME:field=value,..." % (flag, spec))
    extra = {}
    for item in filter(None, kv.split(",")):
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq:
            raise SystemExit("%s %s: %r is not field=value" % (flag, spec, item))
        if key in harness:
            raise SystemExit("%s %s: %s is set by the harness (--budgets)" % (flag, spec, key))
        if key not in fields:
            raise SystemExit("%s %s: kvshade.Profile has no field %r (fields: %s)" %
                             (flag, spec, key, ", ".join(sorted(fields))))
        extra[key] = option_value(val)
    return name, extra


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
        name, extra = parse_shadow_option(spec, fields)
        options.append((name, dict(dict(value_codec="bf16"), **extra)))
    for dec in filter(None, a.decoders.split(",")):
        if dec not in REMOTE_OPTIONS:
            raise SystemExit("--decoders: unknown decoder %r (known: %s)" % (dec, ", ".join(REMOTE_OPTIONS)))
        options.append((dec, dict(value_codec="bf16")))
    if "shadow" in want:
        for opt, kw in options:
            # The option's fields override the harness's defaults (rank, outliers, ...).
            out += [("shadow", "shadow", b, kb[b], opt, dict(dict(base, kind="shadow", sparse_budget=kb[b]), **kw))
                    for b in budgets]
    if "mini" in want:
        recent = max(a.local_window / float(n_tokens), 1e-4)
        minis = [("bf16", {})] + [parse_shadow_option(spec, fields, "--mini-option", MINI_HARNESS_FIELDS)
                                  for spec in a.mini_option]
        for opt, kw in minis:
            out += [("mini", "mini", b, None, opt, dict(dict(kind="mini", mini_recent_ratio=recent,
                                                             mini_heavy_ratio=b / 100.0), **kw))
                    for b in budgets]
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


def _mean(vals):
    vals = [v for v in vals if v is not None]
    return float(np.mean(vals)) if vals else None


def summarize(rows):
    """Rows (one per sample and config) -> one dict per (config, budget, option, task,
    locality): accuracy, agreement with full, recall@k (mean, per layer, worst layer) and
    seconds per decode step in select and in attention."""
    cells = defaultdict(list)
    for r in rows:
        cells[(r["config"], r["budget_pct"], r["option"], r["task"], r["locality"])].append(r)
    out = []
    for (cfg, b, opt, task, loc), rs in sorted(cells.items(), key=lambda kv: str(kv[0])):
        n = len(rs)
        agree = [r["agrees_full"] for r in rs if r.get("agrees_full") is not None]
        by_layer = mean_by_layer([r["recall_by_layer"] for r in rs if r.get("recall_by_layer")])
        worst = layers_worst_first(by_layer)
        mass_by = mean_by_layer([r["mass_recall_by_layer"] for r in rs if r.get("mass_recall_by_layer")])
        mass = layers_worst_first(mass_by)
        steps = sum(r.get("steps", 0) for r in rs)
        out.append(dict(config=cfg, budget_pct=b, option=opt, task=task, locality=loc, n=n,
                        accuracy=100.0 * sum(r["correct"] for r in rs) / n,
                        recall=_mean([r["recall"] for r in rs]),
                        recall_by_layer=by_layer or None,
                        recall_worst_layer=(worst[0][1] if worst else None),
                        recall_layers_worst_first=[[i, v] for i, v in worst] or None,
                        mass_recall_by_layer=mass_by or None,
                        mass_recall_worst_layer=(mass[0][1] if mass else None),
                        agrees_full=(100.0 * sum(agree) / len(agree) if agree else None),
                        steps=steps,
                        attend_s_per_step=(sum(r.get("attend_s", 0.0) for r in rs) / steps if steps else None),
                        select_s_per_step=(sum(r["select_s"] for r in rs if r.get("select_s") is not None) / steps
                                           if steps and any(r.get("select_s") is not None for r in rs) else None)))
    return out


def by_config(summary, cell_order):
    """Summary cells -> per (config, budget, option): mean accuracy over the cells, % of the
    oracle at the same budget, agreement with full, recall@k (mean over the cells, per layer
    worst first), seconds per decode step (over all its decode steps)."""
    groups = defaultdict(dict)
    for c in summary:
        groups[(c["config"], c["budget_pct"], c["option"])][(c["task"], c["locality"])] = c
    out = {}
    for key, cells in groups.items():
        present = [cells[c] for c in cell_order if c in cells]
        acc = _mean([c["accuracy"] for c in present])
        by_layer = mean_by_layer([c["recall_by_layer"] for c in present if c.get("recall_by_layer")])
        worst = layers_worst_first(by_layer)
        mass = layers_worst_first(mean_by_layer([c["mass_recall_by_layer"] for c in present
                                                 if c.get("mass_recall_by_layer")]))
        steps = sum(c["steps"] for c in present)

        def per_step(field):
            have = [c for c in present if c.get(field) is not None]
            n = sum(c["steps"] for c in have)
            return sum(c[field] * c["steps"] for c in have) / n if n else None
        out[key] = dict(config=key[0], budget_pct=key[1], option=key[2], accuracy=acc,
                        agrees_full=_mean([c["agrees_full"] for c in present]),
                        recall=_mean([c["recall"] for c in present]),
                        recall_by_layer=by_layer or None,
                        recall_worst_layer=(worst[0][1] if worst else None),
                        recall_layers_worst_first=[[i, v] for i, v in worst] or None,
                        mass_recall_layers_worst_first=[[i, v] for i, v in mass] or None,
                        steps=steps, attend_s_per_step=per_step("attend_s_per_step"),
                        select_s_per_step=per_step("select_s_per_step"))
    for key, g in out.items():
        orc = out.get(("oracle", key[1], "-"))
        g["pct_of_oracle"] = (100.0 * g["accuracy"] / orc["accuracy"]
                              if orc and orc["accuracy"] and key[0] != "oracle" and key[1] is not None else None)
    return out


CONFIG_ORDER = {"full": 0, "exact": 1, "oracle": 2, "shadow": 3, "mini": 4}


def markdown(summary, cell_order, title=""):
    by = defaultdict(dict)
    for s in summary:
        by[(s["config"], s["budget_pct"], s["option"])][(s["task"], s["locality"])] = s
    conf = by_config(summary, cell_order)
    cols = ["%s/%s" % (t, "loc" if l else "noloc") for t, l in cell_order]
    lines = []
    if title:
        lines.append(title)
        lines.append("")
    extra = ["mean", "% of oracle", "= full", "recall@k", "worst-layer recall@k", "recall@k by layer, worst first",
             "worst-layer mass recall", "select ms/step", "attend ms/step"]
    lines.append("| config | budget | option | " + " | ".join(cols + extra) + " |")
    lines.append("|" + "---|" * (len(cols) + len(extra) + 3))

    def ms(v):
        return "-" if v is None else "%.2f" % (1e3 * v)
    for key in sorted(by, key=lambda k: (CONFIG_ORDER.get(k[0], 9), -1 if k[1] is None else k[1], k[2])):
        cfg, b, opt = key
        g = conf[key]
        vals = [("%.1f" % by[key][c]["accuracy"]) if c in by[key] else "-" for c in cell_order]
        vs = "%.0f%%" % g["pct_of_oracle"] if g["pct_of_oracle"] is not None else "-"
        r = "%.3f" % g["recall"] if g["recall"] is not None else "-"
        ag = "%.1f" % g["agrees_full"] if g["agrees_full"] is not None and cfg != "full" else "-"
        worst = g["recall_layers_worst_first"]
        wl = "%.3f (L%d)" % (worst[0][1], worst[0][0]) if worst else "-"
        layers = ", ".join("L%d %.2f" % (i, v) for i, v in worst) if worst else "-"
        mw = g["mass_recall_layers_worst_first"]
        mwl = "%.3f (L%d)" % (mw[0][1], mw[0][0]) if mw else "-"
        lines.append("| %s | %s | %s | %s | %s |" % (
            cfg, "-" if b is None else "%g%%" % b, opt, " | ".join(vals),
            " | ".join(["%.1f" % g["accuracy"] if g["accuracy"] is not None else "-", vs, ag, r, wl, layers, mwl,
                        ms(g["select_s_per_step"]), ms(g["attend_s_per_step"])])))
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
    ap.add_argument("--tasks", default="mk,vt,fw",
                    help="of %s; kv,kvm: the hard tasks (distinct random words, no chunk locality)"
                         % ",".join(T.ALL_TASKS))
    ap.add_argument("--words", type=int, default=None,
                    help="synthetic vocabulary of the tasks (default: the model's, --weights; else 1024)")
    ap.add_argument("--budgets", default="1.5,3,6", help="percent of the prompt's chunks")
    ap.add_argument("--configs", default="full,oracle,exact,shadow,mini")
    ap.add_argument("--codecs", default="bf16,int4", help="shadow value codecs")
    ap.add_argument("--shadow-option", action="append", default=[],
                    help="NAME:field=value,... another shadow variant (any field of kvshade.Profile but kind and "
                         "sparse_budget; values int, float, true/false, none or a string), at every budget, e.g. "
                         "rerank8:rerank_factor=8, guard:recall_sample_rate=0.25,recall_floor=0.8,recall_action=widen")
    ap.add_argument("--mini-option", action="append", default=[],
                    help="NAME:field=value,... another mini variant (any field of kvshade.Profile but kind, "
                         "mini_recent_ratio and mini_heavy_ratio), at every budget, e.g. g32:kivi_group=32")
    ap.add_argument("--no-auto-options", dest="auto_options", action="store_false",
                    help="do not add the shadow variants kvshade.Profile offers (rerank_factor 4: two-stage "
                         "selection; mass_top_p 0.9 with mass_min_chunks 4: budgets by attention mass)")
    ap.add_argument("--decoders", default="rpc,rpc-spec",
                    help="shadow (bf16) also decoded by kvshade.decoders.remote.RemoteDecoder: rpc (synchronous), rpc-spec "
                         "(speculate-and-correct); empty for none")
    ap.add_argument("--correct-below", type=float, default=0.9, help="rpc-spec: RemoteDecoder correct_below")
    ap.add_argument("--oracle-score", choices=sorted(ORACLE_SCORES), default="softmax",
                    help="how the oracle (and recall@k) ranks chunks: softmax, each query head normalised "
                         "before the group's maximum (as stage 2 ranks); max-logit, the raw maximum logit "
                         "over the group (the evaluation's runs before 2026-12-06)")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--outliers", type=int, default=2)
    ap.add_argument("--local-window", type=int, default=32)
    ap.add_argument("--out-json", default="selection_fidelity.json")
    ap.add_argument("--out-md", default="selection_fidelity.md")
    ap.add_argument("--time-limit-s", type=float, default=0, help="stop taking new samples after this long (0: none)")
    a = ap.parse_args(argv)
    unknown = [t for t in a.tasks.split(",") if t not in T.ALL_TASKS]
    if unknown:
        ap.error("--tasks: unknown task(s) %s (known: %s)" % (", ".join(unknown), ", ".join(T.ALL_TASKS)))

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
    words = a.words or (backbone.c.vocab - T.NUM_SPECIAL if a.weights else T.TaskConfig().words)
    if a.weights and T.NUM_SPECIAL + words > backbone.c.vocab:
        raise SystemExit("--words %d: the model knows %d words" % (words, backbone.c.vocab - T.NUM_SPECIAL))
    cells = T.eval_set(a.seed, T.TaskConfig(words=words), a.length, a.per_cell, tasks=tuple(a.tasks.split(",")))
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
                        att = LocalAttend(pf, k, a.local_window, score=ORACLE_SCORES[a.oracle_score])
                    elif opt in REMOTE_OPTIONS:
                        att = RemoteAttend(client, spec, kvshade.Profile(**prof), pf, ids_np[:-1], dev,
                                           REMOTE_OPTIONS[opt], a.correct_below, worker_id="eval-%d" % si)
                    else:
                        att = KvShadeAttend(client, spec, kvshade.Profile(**prof), pf, ids_np[:-1], k,
                                            worker_id="eval-%d" % si, score=ORACLE_SCORES[a.oracle_score])
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
                    rows.append(dict(**extra, sample=si, task=s.task, locality=s.locality, config=name, budget_pct=b,
                                     k=k, option=opt, correct=int(ok), generated=[int(t) for t in gen],
                                     agrees_full=(None if full_gen is None else int(gen == full_gen)),
                                     answer=[int(t) for t in s.answer],
                                     recall=(float(np.mean(rec)) if rec else None),
                                     recall_by_layer=(att.recall_by_layer() if rec else None),
                                     mass_recall_by_layer=(att.recall_by_layer(mass=True) if rec else None),
                                     steps=len(gen), attend_s=att.attend_s, select_s=getattr(att, "select_s", None)))
                    timing[(name, opt)] += time.time() - t1
                if si % 6 == 5:
                    print("%d/%d samples, %.0f s" % (si + 1, len(samples), time.time() - t0), flush=True)
    finally:
        if server:
            server.stop()
    summary = summarize(rows)
    cell_order = [(t, l) for t in a.tasks.split(",") for l in T.task_localities(t)]
    title = ("Selection fidelity: %s, %d-token prompts, %d samples per cell, rank %d, %d outliers, local %d, "
             "C %d; accuracy %% (exact match of the answer); = full: %% of samples decoded exactly as with full "
             "attention; recall@k by layer: L<layer> <recall>, worst first; mass recall: the attention mass in the "
             "selected units over the mass in the oracle's; ms/step: milliseconds per decode step "
             "(all layers) in Client.select and in the config's whole attention call" % (
                 os.path.basename(src_name), a.length, a.per_cell, a.rank, a.outliers, a.local_window, CHUNK))
    md = markdown(summary, cell_order, title) + speculation_note(rows)
    print(md)
    elapsed = time.time() - t0
    with open(a.out_md, "w") as f:
        f.write(md)
    with open(a.out_json, "w") as f:
        json.dump(dict(args=vars(a), model_meta=meta, model_id=model_id, seconds=round(elapsed, 1),
                       seconds_by_config={"%s/%s" % k: round(v, 2) for k, v in timing.items()},
                       task_config=dict(words=words), by_config=list(by_config(summary, cell_order).values()),
                       summary=summary, rows=rows), f, indent=1)
    print("evaluated %d samples in %.0f s -> %s, %s" % (len({r['sample'] for r in rows}), elapsed, a.out_md, a.out_json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
