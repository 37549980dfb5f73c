#!/usr/bin/env python3
"""Two worker processes attached to one kvshade session.

The document's KV cache is ingested once (by this parent process). Then two worker
PROCESSES, each with its own connection, attach to that one session:

  writer  attaches with writer=True; per decode step it runs select-and-reconstruct for
          every layer (applying each slot-table delta to its slot buffers), "generates" a
          token and appends its pre-RoPE K and V for every layer (AppendTokens);
  reader  attaches read-only; per step it decodes with select for every layer too, and
          checks what the service shows it of the writer's work: the session's token
          count, and the newest row of its exact tail (GetStaticSet), which must be the
          writer's appended key after RoPE at that position.

The two run in lockstep (the parent passes a message per step) so the printout is
deterministic; each prints what it saw. The K/V are synthetic (seeded), so the reader can
recompute what the writer appended; a real runtime would take them from its model.

    python3 client/examples/two_workers.py --target 127.0.0.1:50551
    python3 client/examples/two_workers.py --spawn build/service/kvshade-server [--ucx tcp,self]

--ucx: the workers use the UCX data plane (the spawned server gets `ucx.enable: true`);
a worker whose client fell back to gRPC fails.
"""
import argparse
import multiprocessing as mp
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import kvshade  # noqa: E402
from example_util import rope, spawn  # noqa: E402

LAYERS, HQ, H, D, C = 2, 8, 2, 64, 8



def bf16(x):
    return kvshade.bf16_bits_to_f32(kvshade.f32_to_bf16_bits(x)).reshape(np.shape(x))


def generated_kv(seed, step):
    """The writer's token of `step`: pre-RoPE K, V [L, 1, H, D], bf16-representable."""
    rng = np.random.default_rng([seed, 1, step])
    return (bf16(rng.standard_normal((LAYERS, 1, H, D)).astype(np.float32)),
            bf16(rng.standard_normal((LAYERS, 1, H, D)).astype(np.float32)))


def query(seed, role, step, layer, pos):
    rng = np.random.default_rng([seed, 2, role, step, layer])
    return rope(rng.standard_normal((1, HQ, D)).astype(np.float32), np.array([pos]))[0]


class SlotMirror:
    """The worker's slot buffers of one layer: chunk id per (head, slot), filled by deltas."""

    def __init__(self, slots):
        self.chunk = -np.ones((H, slots), dtype=np.int64)

    def apply(self, d):
        self.chunk[d.head, d.slot] = d.chunk


def worker(role, args, session_id, n_doc, conn):
    """Runs in its own process: role 0 = writer, 1 = reader. Sends one line per step."""
    name = ("writer", "reader")[role]
    try:
        with kvshade.Client(args.target, token=args.token, use_ucx=bool(args.ucx),
                            ucx_transports=args.ucx or None) as c:
            att = c.attach(session_id, "example-%s" % name, writer=(role == 0))
            mirrors = [SlotMirror(att.slots_per_head) for _ in range(LAYERS)]
            for step in range(args.steps):
                if role == 1:
                    conn.recv()  # the writer has appended this step's token
                pos = n_doc + step
                misses = hits = 0
                for l in range(LAYERS):
                    (d,) = c.select(l, [att.attachment_id], query(args.seed, role, step, l, pos))
                    mirrors[l].apply(d)
                    misses += len(d.head)
                    hits += d.hits
                    assert np.isfinite(d.keys).all() and np.isfinite(d.values).all()
                line = "%s step %d: select %d layers, %d chunks delivered, %d slot hits" % (
                    name, step, LAYERS, misses, hits)
                if role == 0:
                    k, v = generated_kv(args.seed, step)
                    tokens = c.append(session_id, [1000 + step], k, v, attachment_id=att.attachment_id)
                    line += "; appended token %d -> session has %d tokens" % (1000 + step, tokens)
                else:
                    tokens = c.get_session(session_id)["tokens"]
                    st = c.static_set(att.attachment_id, 0)
                    k, _ = generated_kv(args.seed, step)
                    want = rope(k[0], np.array([pos]))[0]  # [H, D], the writer's key at pos
                    got = st.tail_k[-1]
                    err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-6))
                    ok = tokens == n_doc + step + 1 and err < 2e-2
                    line += "; sees %d tokens, newest tail key %s the writer's (rel. err %.1e)" % (
                        tokens, "is" if ok else "is NOT", err)
                    if not ok:
                        raise AssertionError(line)
                conn.send(("step", line))
                if role == 0:
                    conn.recv()  # the reader is done with this step
            if args.ucx:
                connected, fallbacks = c.ucx_connected, c.ucx_fallbacks
                line = "%s: decoded over %s, %d fallbacks to gRPC" % (
                    name, "UCX" if connected else "gRPC", fallbacks)
                if not connected or fallbacks:
                    raise AssertionError(line + " (UCX was asked for)")
                conn.send(("step", line))
            c.detach(att.attachment_id)
        conn.send(("done", None))
    except Exception as e:  # reported by the parent, which exits non-zero
        conn.send(("error", "%s: %s: %s" % (name, type(e).__name__, e)))



def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="127.0.0.1:50551")
    ap.add_argument("--spawn", metavar="KVSHADE_SERVER", help="start this server binary on a free port")
    ap.add_argument("--ucx", metavar="TRANSPORTS", default="",
                    help="workers use the UCX data plane with these UCX_TLS (e.g. tcp,self)")
    ap.add_argument("--token", default=None, help="bearer token")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    proc = None
    if args.spawn:
        proc, args.target = spawn(args.spawn, args.ucx)
    rng = np.random.default_rng(args.seed)
    model = kvshade.ModelSpec("example/two-workers", LAYERS, HQ, H, D)
    profile = kvshade.Profile("shadow", rank=64, chunk_size=C, sparse_budget=16, outliers=4, local_window=32)
    rc = 0
    try:
        with kvshade.Client(args.target, token=args.token) as c:
            c.wait_ready(20)
            doc = None
            try:
                ids = rng.integers(0, 32000, args.doc_tokens)
                doc = c.create_session(model, profile, ids, label="two-workers document")
                k = rng.standard_normal((LAYERS, args.doc_tokens, H, D)).astype(np.float32)
                v = rng.standard_normal((LAYERS, args.doc_tokens, H, D)).astype(np.float32)
                if doc.tokens_to_ingest > 0:
                    # Only the tokens after the cached prefix are sent.
                    with c.ingest(doc.session_id) as ing:
                        for l in range(LAYERS):
                            ing.layer(l, k[l][doc.reused_tokens:], v[l][doc.reused_tokens:])
                        ing.commit()
                    print("document: session %s, %d tokens ingested once, %d reused from the prefix cache"
                          % (doc.session_id, doc.tokens_to_ingest, doc.reused_tokens))
                else:
                    # The whole document is in the prefix cache (e.g. a second run against the
                    # same server): the session is ready as created, there is nothing to ingest.
                    print("document: session %s, all %d tokens reused from the prefix cache, nothing to ingest"
                          % (doc.session_id, doc.reused_tokens))

                # Spawned (not forked) processes: each worker starts its own interpreter and its
                # own connection, as separate runtime processes would.
                ctx = mp.get_context("spawn")
                pipes = [ctx.Pipe() for _ in range(2)]
                procs = [ctx.Process(target=worker, args=(role, args, doc.session_id, args.doc_tokens,
                                                          pipes[role][1]), daemon=True) for role in range(2)]
                for p in procs:
                    p.start()
                writer, reader = pipes[0][0], pipes[1][0]
                errors = []

                def recv(conn):
                    kind, payload = conn.recv()
                    if kind == "error":
                        errors.append(payload)
                    elif kind == "step":
                        print("  " + payload)
                    return kind

                for step in range(args.steps):
                    if recv(writer) != "step":
                        break
                    reader.send("go")          # the reader may look now
                    if recv(reader) != "step":
                        break
                    writer.send("next")        # the writer may go on
                if not errors:
                    while recv(writer) == "step":
                        pass
                    while recv(reader) == "step":
                        pass
                for p in procs:
                    if errors:
                        p.terminate()  # the other worker may be waiting for a step that never comes
                    p.join(60)
                info = c.get_session(doc.session_id)
                print("document session now: %d tokens (%d appended by the writer), %d attachments"
                      % (info["tokens"], info["tokens"] - args.doc_tokens, info["attachments"]))
                if errors or any(p.exitcode != 0 for p in procs):
                    print("FAILED: " + "; ".join(errors or ["a worker exited with %s" % [p.exitcode for p in procs]]))
                    rc = 1
            finally:
                # Also when a call failed: closing the session ends its attachments; the
                # document's prefix stays cached for the next run.
                if doc is not None:
                    try:
                        c.close_session(doc.session_id)
                    except kvshade.KvShadeError as e:
                        print("could not close session %s: %s" % (doc.session_id, e), file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    sys.exit(rc)


if __name__ == "__main__":
    main()
