#!/usr/bin/env python3
"""Prefix-cached document QA with the kvshade Python package.

A document's KV cache is ingested once (profile `shadow`); every question forks the
document session (zero copy), appends the question's tokens, attaches a worker and
decodes with select-and-reconstruct per layer (the worker applies each slot-table delta to
its slot buffers) and `Attend` for the attention output. A later CreateSession with the
same document finds it in the prefix cache (LookupPrefix here; CreateSession
reports it as reused_tokens and ingests only the rest).

The K/V here are synthetic (low-rank keys, random values, a planted "needle" each question
looks for) so the example runs without a model; a real runtime passes its own pre-RoPE
keys, values and post-RoPE queries instead. The worker keeps each layer's slot table
(slot -> chunk, from the deltas) and checks that the needle's chunk is in it for every KV
head at every layer and step: the example exits with status 1 when it is not.

    python3 client/examples/doc_qa.py --target 127.0.0.1:50551
    KVSHADE_LIB=build/client/libkvshade.so python3 client/examples/doc_qa.py --spawn build/service/kvshade-server
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import kvshade  # noqa: E402
from example_util import rope, spawn  # noqa: E402

LAYERS, HQ, H, D, C = 2, 8, 2, 64, 8



def synthetic_kv(rng, n, basis):
    """Keys [L, n, H, D] of rank basis.shape[0] plus noise; values Gaussian."""
    lat = rng.standard_normal((LAYERS, n, basis.shape[0])).astype(np.float32)
    k = np.einsum("lnr,rx->lnx", lat, basis).reshape(LAYERS, n, H, D)
    k += 0.05 * rng.standard_normal(k.shape).astype(np.float32)
    v = rng.standard_normal((LAYERS, n, H, D)).astype(np.float32)
    return k, v



def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="127.0.0.1:50551")
    ap.add_argument("--spawn", metavar="KVSHADE_SERVER", help="start this server binary on a free port")
    ap.add_argument("--token", default=None, help="bearer token")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--question-tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget", type=int, default=16, help="sparse budget: chunks per KV head per step")
    ap.add_argument("--needle-scale", type=float, default=4.0,
                    help="strength of the needle planted in the document's keys (0: none, and the check fails)")
    args = ap.parse_args()

    proc = None
    if args.spawn:
        proc, args.target = spawn(args.spawn)
    rng = np.random.default_rng(0)
    model = kvshade.ModelSpec("example/doc-qa", LAYERS, HQ, H, D)
    profile = kvshade.Profile("shadow", rank=64, chunk_size=C, sparse_budget=args.budget, outliers=4,
                              local_window=32)
    basis = rng.standard_normal((24, H * D)).astype(np.float32)
    doc_ids = rng.integers(0, 32000, args.doc_tokens)
    doc_k, doc_v = synthetic_kv(rng, args.doc_tokens, basis)
    # A needle: a span of keys sharing one direction that the questions' queries look for.
    needle_at = (args.doc_tokens // 2) // C * C
    needle = rng.standard_normal((H, D)).astype(np.float32)
    doc_k[:, needle_at:needle_at + C] += args.needle_scale * needle
    if args.needle_scale != 0:
        # The needle's keys come from its own tokens (ids above the random ones): the prefix
        # cache, keyed by token ids, then never serves a document without it for one with it.
        doc_ids[needle_at:needle_at + C] = 32000 + np.arange(C)
    missed = []  # (question, layer-steps where some head's slot table lacked the needle)

    try:
        with kvshade.Client(args.target, token=args.token) as c:
            c.wait_ready(20)
            open_sessions = []  # closed in the `finally` below, also when a call fails
            try:
                t0 = time.monotonic()
                doc = c.create_session(model, profile, doc_ids, label="document")
                open_sessions.append(doc.session_id)
                if doc.tokens_to_ingest > 0:
                    # Only the tokens after the cached prefix are sent.
                    with c.ingest(doc.session_id) as ing:
                        for l in range(LAYERS):
                            ing.layer(l, doc_k[l][doc.reused_tokens:], doc_v[l][doc.reused_tokens:])
                        ing.commit()
                    print("document: %d tokens ingested in %.2fs, %d reused from the prefix cache (session %s)"
                          % (doc.tokens_to_ingest, time.monotonic() - t0, doc.reused_tokens, doc.session_id))
                else:
                    # The whole document is in the prefix cache (e.g. a second run against the
                    # same server): the session is ready as created, there is nothing to ingest.
                    print("document: all %d tokens reused from the prefix cache, nothing to ingest (session %s)"
                          % (doc.reused_tokens, doc.session_id))

                again = c.lookup_prefix(model, profile, doc_ids)
                print("prefix cache: %d of %d document tokens reusable" % (again[0], args.doc_tokens))

                for qi in range(args.questions):
                    child, shared = c.fork_session(doc.session_id, args.doc_tokens)
                    open_sessions.append(child)
                    q_ids = rng.integers(0, 32000, args.question_tokens)
                    qk, qv = synthetic_kv(rng, args.question_tokens, basis)
                    c.append(child, q_ids, qk, qv)
                    att = c.attach(child, "example-worker-%d" % qi)
                    pos = args.doc_tokens + args.question_tokens
                    misses = hits = selected = 0
                    needle_chunk = needle_at // C
                    slot_tables = [dict() for _ in range(LAYERS)]  # per layer: (head, slot) -> chunk
                    found = 0
                    for step in range(args.steps):
                        for l in range(LAYERS):
                            q = (np.repeat(needle, HQ // H, axis=0)
                                 + 0.1 * rng.standard_normal((HQ, D)).astype(np.float32))
                            q = rope(q[None], np.array([pos + step]))[0]
                            (delta,) = c.select(l, [att.attachment_id], q)
                            misses += len(delta.head)
                            hits += delta.hits
                            selected += delta.selected
                            for hh, sl, ch in zip(delta.head, delta.slot, delta.chunk):
                                slot_tables[l][(int(hh), int(sl))] = int(ch)
                            held = {hh for (hh, _), ch in slot_tables[l].items() if ch == needle_chunk}
                            found += int(len(held) == H)
                            out = c.attend(l, [att.attachment_id], q)[0]
                            assert np.isfinite(out).all()
                    print("question %d: forked %d shared tokens; %d steps x %d layers: %d chunks selected, "
                          "%d hits, %d delivered; needle chunk attended by every head in %d of %d layer-steps"
                          % (qi, shared, args.steps, LAYERS, selected, hits, misses, found, args.steps * LAYERS))
                    if found < args.steps * LAYERS:
                        missed.append((qi, args.steps * LAYERS - found))
                    c.detach(att.attachment_id)
                    c.close_session(child)
                    open_sessions.remove(child)
                c.close_session(doc.session_id)
                open_sessions.remove(doc.session_id)
            finally:
                # Closing a session also ends its attachments; the document's prefix stays
                # cached for the next run.
                for sid in open_sessions:
                    try:
                        c.close_session(sid)
                    except kvshade.KvShadeError as e:
                        print("could not close session %s: %s" % (sid, e), file=sys.stderr)
            print("stats:", {k: v for k, v in c.stats().items() if k in ("sessions", "prefix_hits", "chunk_hits",
                                                                        "chunks_selected")})
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    for qi, n in missed:
        print("error: question %d: the needle's chunk %d was missing from a head's slot table in %d "
              "layer-steps" % (qi, needle_at // C, n), file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
