#!/usr/bin/env python3
"""How much of the exact top-k a key signature's logits keep, by signature width, where the
attention is spread thin: Gaussian keys (no structure for a landmark to capture), stage 2
over every chunk, each query head's log-softmax over the prompt, the chunk's score the
maximum over its tokens and the group's query heads (docs/ALGORITHM.md "Two-stage
selection", "Key signatures": the record's residual from the chunk mean, one scale per
record, codes clamp(rint(res / scale + half))). The query stays in float here (the int8
query's step is far below the codes'). Behind docs/ALGORITHM.md "Key signatures" (what
they buy).

Usage: /usr/bin/python3 bench/probes/signature_recall.py [--draws 20] [--budget 0.06]
"""
import argparse

import numpy as np


def quantize(res, bits):
    half = (2 ** bits - 1) / 2
    scale = np.abs(res).max(-1, keepdims=True) / half
    code = np.clip(np.rint(res / scale + half), 0, 2 ** bits - 1)
    return (code - half) * scale


def chunk_scores(q, k, chunk):
    logits = q @ k.T
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return logp.reshape(q.shape[0], -1, chunk).max(-1).max(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--g", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--budget", type=float, default=0.06, help="k as a share of the chunks")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    n_chunks = a.tokens // a.chunk
    k = int(round(a.budget * n_chunks))
    print("tokens %d, d %d, g %d, C %d, k %d of %d chunks, %d draws" % (a.tokens, a.d, a.g, a.chunk, k,
                                                                         n_chunks, a.draws))
    for logit_std in (0.5, 1.0, 2.0, 4.0):
        for bits in (2, 4, 8):
            kept = []
            for _ in range(a.draws):
                keys = rng.standard_normal((a.tokens, a.d))
                q = rng.standard_normal((a.g, a.d)) * logit_std / np.sqrt(a.d)
                lm = keys.reshape(n_chunks, a.chunk, a.d).mean(1)
                res = keys.reshape(n_chunks, a.chunk, a.d) - lm[:, None]
                approx = (quantize(res, bits) + lm[:, None]).reshape(a.tokens, a.d)
                exact = set(np.argsort(-chunk_scores(q, keys, a.chunk))[:k])
                got = set(np.argsort(-chunk_scores(q, approx, a.chunk))[:k])
                kept.append(len(exact & got) / k)
            print("logit std %.1f  %d bits: recall@k %.3f" % (logit_std, bits, float(np.mean(kept))))


if __name__ == "__main__":
    main()
