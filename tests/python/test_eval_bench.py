"""The selection-fidelity evaluation (bench/eval): the task generator's answers, the oracle
chunk choice and recall@k on planted cases, and the evaluation model's decode path against
its own training forward. No server; a few seconds on the CPU."""
import os
import sys
import unittest

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "eval"))
import tasks as T  # noqa: E402
from evaluate import (LocalAttend, attend_tokens, chunk_max_logits, match_static_chunks,  # noqa: E402
                      oracle_topk, recall_at_k)
from model import EvalLM, ModelConfig, OwnBackbone  # noqa: E402


class Generator(unittest.TestCase):
    def test_answers_match_the_task_definitions(self):
        cfg = T.TaskConfig()
        for length in (512, 2048):
            for s in T.eval_set(7, cfg, length, 6):
                self.assertEqual(len(s.prompt), length)
                self.assertEqual(s.prompt[0], T.BOS)
                self.assertEqual(T.solve(s.prompt), [int(t) for t in s.answer], (s.task, s.locality))
                if s.task == "mk":
                    self.assertEqual(len(s.answer), 2)
                elif s.task == "vt":
                    self.assertEqual(len(s.answer), cfg.hops)
                else:
                    self.assertEqual(len(s.answer), 1)

    def test_variable_chain_by_hand(self):
        # VAR a N ... VAR b a ... VAR c b; QVAR c -> b a N
        a, b, c, n = 100, 101, 102, 103
        p = [T.BOS, 50, T.VAR, a, n, 51, T.VAR, b, a, T.VAR, c, b, 52, T.QVAR, c]
        self.assertEqual(T.solve(p), [b, a, n])
        p = [T.BOS, T.ITEM, 70, T.ITEM, 71, T.ITEM, 70, 60, T.QFREQ, T.ANS]
        self.assertEqual(T.solve(p), [70])
        p = [T.BOS, T.KEY, 80, 81, 82, T.END, T.KEY, 83, 84, 85, T.END, T.Q, 83]
        self.assertEqual(T.solve(p), [84, 85])

    def test_locality(self):
        cfg = T.TaskConfig()
        unaligned = 0
        for s in T.eval_set(3, cfg, 1024, 4):
            if s.locality:
                for a, _ in s.spans:
                    self.assertEqual(a % T.CHUNK, 0, "a record must start a chunk with locality")
                rec = np.zeros(len(s.prompt), bool)
                for a, b in s.spans:
                    rec[a:a + T.CHUNK] = True
                for c in range(1, len(s.prompt) // T.CHUNK - 1):
                    ch = s.prompt[c * T.CHUNK:(c + 1) * T.CHUNK]
                    if rec[c * T.CHUNK] or (ch < T.NUM_SPECIAL).any():
                        continue
                    self.assertEqual(len(set(((ch - T.NUM_SPECIAL) // T.TOPIC).tolist())), 1,
                                     "filler chunk %d mixes topics" % c)
            else:
                unaligned += sum(a % T.CHUNK != 0 for a, _ in s.spans)
        self.assertGreater(unaligned, 0, "without locality records start anywhere")

    def test_deterministic_and_train_mask(self):
        cfg = T.TaskConfig()
        a = T.eval_set(11, cfg, 512, 2)
        b = T.eval_set(11, cfg, 512, 2)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x.prompt, y.prompt)
        rng = np.random.default_rng(5)
        for task in T.TASKS:
            toks, mask = T.make_train_sequence(rng, cfg, task, 512, True)
            self.assertEqual(len(toks), 512)
            # The masked tokens are the answers, in order, each after its question's ANS.
            ans = toks[mask]
            self.assertGreater(len(ans), 0)
            idx = np.nonzero(mask)[0]
            starts = [i for i in idx if not mask[i - 1]]
            for i in starts:
                self.assertIn(toks[i - 2], (T.Q, T.QVAR, T.QFREQ))
            # The first question's answer is what solve() says for the prompt up to it.
            first = starts[0]
            self.assertEqual(T.solve(toks[:first]), [int(t) for t in toks[first:first + len(T.solve(toks[:first]))]])


class Oracle(unittest.TestCase):
    def planted(self):
        """64 tokens (8 chunks of 8), 2 KV heads, 2 query heads each, d 4; q = e0 for all."""
        h, hq, d, n = 2, 4, 4, 64
        k = torch.zeros(n, h, d)
        k[:, :, 1] = 1.0                       # neutral
        k[3 * 8 + 5, 0, 0] = 9.0               # head 0: one token in chunk 3 stands out
        for t in range(5 * 8, 6 * 8):          # head 0: chunk 5 uniformly fairly high (high mean)
            k[t, 0, 0] = 4.0
        k[2 * 8 + 1, 1, 0] = 7.0               # head 1: chunk 2 ...
        k[6 * 8 + 7, 1, 0] = 8.0               # ... and chunk 6 (higher)
        k[7 * 8, 1, 0] = -20.0                 # a very negative token changes nothing for chunk 7
        q = torch.zeros(hq, d)
        q[:, 0] = 1.0
        return q, k

    def test_max_logit_not_mean(self):
        q, k = self.planted()
        s = chunk_max_logits(q, k, 8)
        self.assertEqual(tuple(s.shape), (2, 8))
        self.assertAlmostEqual(float(s[0, 3]), 9.0 / 2.0, places=5)   # / sqrt(d) = 2
        self.assertAlmostEqual(float(s[0, 5]), 4.0 / 2.0, places=5)
        self.assertEqual(oracle_topk(s, 1)[0], {3}, "the max logit, not the chunk mean, ranks chunks")
        self.assertEqual(oracle_topk(s, 2), [{3, 5}, {6, 2}])
        # Excluded chunks (sink, outliers) leave the pool; ties go to the lower chunk id.
        self.assertEqual(oracle_topk(s, 2, [{3}, {6}]), [{5, 0}, {2, 0}])

    def test_recall(self):
        self.assertEqual(recall_at_k([{3, 5}, {2, 6}], [{3, 5}, {6, 2}], 2), 1.0)
        self.assertEqual(recall_at_k([{3, 7}, {1, 4}], [{3, 5}, {6, 2}], 2), 0.25)
        self.assertEqual(recall_at_k([{1}, {2}], [{3}, {4}], 1), 0.0)

    def test_static_chunks_found_by_key(self):
        _, k = self.planted()
        k = k + 0.01 * torch.randn(k.shape, generator=torch.Generator().manual_seed(0))
        rows = torch.zeros(2, 16, 4)
        rows[0, :8] = k[0:8, 0]                 # head 0: sink chunk and chunk 3
        rows[0, 8:16] = k[24:32, 0]
        rows[1, :8] = k[40:48, 1]               # head 1: chunk 5 only
        self.assertEqual(match_static_chunks(rows.numpy(), np.array([16, 8]), k), [{0, 3}, {5}])

    def test_oracle_attention(self):
        g = torch.Generator().manual_seed(1)
        n, h, hq, d = 64 + 32 + 3, 2, 4, 8   # 8 chunks, a 35-token tail (local 32)
        k, v = torch.randn(n, h, d, generator=g), torch.randn(n, h, d, generator=g)
        kp = k.clone()
        from model import Prefill
        pf = Prefill([kp], [k], [v], [k[:1]], None)
        q = torch.randn(hq, d, generator=g)
        kn, vn = torch.randn(h, d, generator=g), torch.randn(h, d, generator=g)
        full = LocalAttend(pf).attend(0, q, kn, vn)
        allk = LocalAttend(pf, budget=8).attend(0, q, kn, vn)
        torch.testing.assert_close(allk, full, rtol=1e-5, atol=1e-6)
        # Budget 2: sink + the 2 best chunks + tail (64..98) + the new token, per head.
        got = LocalAttend(pf, budget=2).attend(0, q, kn, vn)
        top = oracle_topk(chunk_max_logits(q, k, 8), 2, [{0}, {0}])
        keys, vals = [], []
        for j in range(h):
            idx = [t for c in sorted({0} | top[j]) for t in range(c * 8, c * 8 + 8)] + list(range(64, n))
            keys.append(torch.cat([k[idx, j], kn[None, j]]))
            vals.append(torch.cat([v[idx, j], vn[None, j]]))
        torch.testing.assert_close(got, attend_tokens(q, keys, vals), rtol=1e-5, atol=1e-6)
        self.assertFalse(torch.allclose(got, full, atol=1e-3), "a partial budget must differ from full attention")


class EvalModel(unittest.TestCase):
    def test_decode_step_equals_forward(self):
        torch.manual_seed(0)
        c = ModelConfig(vocab=T.TaskConfig().vocab, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=16, ffn=128)
        m = EvalLM(c)
        with torch.no_grad():   # larger weights than at init, so that the layers matter
            for p in m.parameters():
                p.mul_(4.0)
        ids = T.eval_set(2, T.TaskConfig(), 96, 1, tasks=("mk",), localities=(False,))[0].prompt
        with torch.no_grad():
            want = m(torch.as_tensor(ids)[None])[0, -1]
        bb = OwnBackbone(m, torch.device("cpu"))
        pf = bb.prefill(ids[:-1])
        got = bb.step(ids[-1], len(ids) - 1, LocalAttend(pf).attend)
        scale = float(want.abs().max())
        self.assertLess(float((got - want).abs().max()) / scale, 0.02)   # bf16-rounded q/k/v
        self.assertEqual(int(got.argmax()), int(want.argmax()))


if __name__ == "__main__":
    unittest.main()
