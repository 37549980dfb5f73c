"""The selection-fidelity evaluation (bench/eval): the task generator's answers (the hard
tasks' too: distinct words, no chunk locality), the oracle chunk choice, recall@k and its
per-layer aggregation on planted cases, the shadow options' parsing, and the evaluation
model's decode path against its own training forward. No server; a few seconds on the CPU."""
import dataclasses
import math
import os
import sys
import unittest

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "eval"))
import tasks as T  # noqa: E402
from evaluate import (LocalAttend, attend_tokens, by_config, chunk_max_logits, chunk_softmax_max,  # noqa: E402
                      group_logits, layers_worst_first, markdown, mass_recall, match_static_chunks, mean_by_layer,
                      option_value, oracle_topk, parse_shadow_option, profile_fields, recall_at_k, summarize,
                      unit_mass)
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


class HardTasks(unittest.TestCase):
    """kv (span retrieval) and kvm (majority span) over distinct random words."""

    def samples(self, seed=7, length=2048, per_cell=12, words=4096):
        return T.eval_set(seed, T.TaskConfig(words=words), length, per_cell, tasks=T.KV_TASKS)

    def test_answers_match_the_solver(self):
        for words in (1024, 4096):
            for length in (512, 2048):
                ss = self.samples(length=length, words=words, per_cell=6)
                self.assertEqual([s.task for s in ss], ["kv"] * 6 + ["kvm"] * 6)
                for s in ss:
                    self.assertEqual(len(s.prompt), length)
                    self.assertFalse(s.locality, "the hard tasks come only without chunk locality")
                    self.assertEqual(s.prompt[0], T.BOS)
                    self.assertIn(int(s.prompt[-2]), T.SPAN_LENGTH)
                    self.assertEqual(T.SPAN_LENGTH[int(s.prompt[-2])], len(s.answer))
                    self.assertEqual(T.solve(s.prompt), [int(t) for t in s.answer], s.task)
                    if s.task == "kv":
                        self.assertIn(len(s.answer), (2, 3, 4))
                    else:
                        self.assertEqual(len(s.answer), 2)

    def test_by_hand(self):
        # Q3 k: the 3 words after k; Q2 k with k 3 times: the span that follows it most often.
        k, a, b, c = 500, 501, 502, 503
        p = [T.BOS, 40, k, a, b, c, 41, 42, T.Q3, k]
        self.assertEqual(T.solve(p), [a, b, c])
        p = [T.BOS, k, a, b, 60, k, c, 61, 62, k, a, b, 63, T.Q2, k]
        self.assertEqual(T.solve(p), [a, b])
        with self.assertRaises(ValueError):   # a tie has no answer
            T.solve([T.BOS, k, a, b, k, c, 61, 62, T.Q2, k])

    def test_keys_unique_and_words_distinct(self):
        for s in self.samples(words=4096):
            ctx = s.prompt[1:-2]
            self.assertTrue((ctx >= T.NUM_SPECIAL).all(), "no markers in the context")
            key = int(s.prompt[-1])
            occ = int((ctx == key).sum())
            record_words = {int(w) for a, b in s.spans for w in s.prompt[a:b]}
            filler = np.ones(len(s.prompt), bool)
            for a, b in s.spans:
                filler[a:b] = False
            filler_words = s.prompt[1:-2][filler[1:-2]]
            # Filler: distinct words (the vocabulary allows), none of them a record's.
            self.assertEqual(len(set(filler_words.tolist())), len(filler_words))
            self.assertFalse(record_words & set(filler_words.tolist()))
            if s.task == "kv":
                self.assertEqual(occ, 1, "the asked key occurs exactly once")
                self.assertEqual(len(set(ctx.tolist())), len(ctx), "every context word distinct")
                keys = [int(s.prompt[a]) for a, _ in s.spans]
                self.assertEqual(len(set(keys)), len(keys))
                self.assertEqual(len(s.spans), T.TaskConfig().kv_records)
            else:
                n = T.kvm_records(len(s.prompt), T.TaskConfig())
                self.assertEqual(occ, n, "kvm: the asked key in N records")
                self.assertEqual(len(s.spans), 2 * n, "and as many of the distractor key")
                spans = [tuple(s.prompt[a + 1:b].tolist()) for a, b in s.spans if s.prompt[a] == key]
                counts = sorted((spans.count(x) for x in set(spans)), reverse=True)
                self.assertGreaterEqual(counts[0] - (counts[1] if len(counts) > 1 else 0),
                                        max(1, round(T.TaskConfig().kvm_gap * n)))
        # Past the vocabulary the filler repeats, the records' words still do not.
        for s in self.samples(words=1024, length=2048, per_cell=3):
            key = int(s.prompt[-1])
            if s.task == "kv":
                self.assertEqual(int((s.prompt[1:-2] == key).sum()), 1)
            self.assertLessEqual(np.bincount(s.prompt[1:-2]).max(),
                                 max(3, T.kvm_records(2048, T.TaskConfig())))

    def test_no_chunk_locality(self):
        offsets, straddle, spans = set(), 0, 0
        for s in self.samples(length=2048, per_cell=16):
            for a, b in s.spans:
                offsets.add(a % T.CHUNK)
                straddle += (a // T.CHUNK) != ((b - 1) // T.CHUNK)
                spans += 1
        self.assertEqual(offsets, set(range(T.CHUNK)), "records start at every offset in a chunk")
        self.assertGreater(straddle, spans // 5, "records straddle chunk boundaries")
        # The answer's words sit at varied offsets too (the decode steps look up single words).
        ans_off = set()
        for s in self.samples(length=2048, per_cell=16):
            if s.task == "kv":
                i = int(np.nonzero(s.prompt[:-2] == s.answer[0])[0][0])
                ans_off.add(i % T.CHUNK)
        self.assertGreaterEqual(len(ans_off), 6)

    def test_deterministic_and_train_sequences(self):
        a, b = self.samples(seed=3, per_cell=2), self.samples(seed=3, per_cell=2)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x.prompt, y.prompt)
            np.testing.assert_array_equal(x.answer, y.answer)
        c = self.samples(seed=4, per_cell=2)
        self.assertFalse(all(np.array_equal(x.prompt, y.prompt) for x, y in zip(a, c)))
        cfg = T.TaskConfig(words=4096, kv_records=16, vary=True)
        rng = np.random.default_rng(9)
        for task in T.KV_TASKS:
            for length in (64, 256, 2048):
                toks, mask = T.make_train_sequence(rng, cfg, task, length, True)
                self.assertEqual(len(toks), length)
                idx = np.nonzero(mask)[0]
                starts = [i for i in idx if not mask[i - 1]]
                self.assertGreater(len(starts), 0)
                for i in starts:   # every question's answer is the solver's for the tokens before it
                    self.assertIn(int(toks[i - 2]), T.SPAN_LENGTH)
                    m = T.SPAN_LENGTH[int(toks[i - 2])]
                    self.assertTrue(mask[i:i + m].all())
                    self.assertEqual(T.solve(toks[:i]), toks[i:i + m].tolist())
        # rep (training only): the context again from one of its words on, every copied word
        # after the first an answer, each the word that followed the previous one.
        for length in (64, 512):
            toks, mask = T.make_train_sequence(rng, cfg, "rep", length, False)
            self.assertEqual(len(toks), length)
            eq = int(np.nonzero(toks == T.EQ)[0][0])
            ctx, copy = toks[1:eq].tolist(), toks[eq + 1:].tolist()
            self.assertEqual(len(set(ctx)), len(ctx))
            j = ctx.index(copy[0])
            self.assertEqual(ctx[j:j + len(copy)], copy)
            self.assertFalse(mask[:eq + 2].any())
            self.assertTrue(mask[eq + 2:].all())

    def test_kvm_records_between_the_budgets(self):
        # At 8K (1019 chunks of the ingested prompt): N above the 1.5 % budget (15 chunks),
        # within the 6 % one (61), so the oracle chunk choice loses at 1.5 % and not at 6 %.
        n = T.kvm_records(8192, T.TaskConfig())
        chunks = (8192 - 1) // T.CHUNK
        self.assertGreater(n, round(0.015 * chunks))
        self.assertLess(n, round(0.06 * chunks))
        rng = np.random.default_rng(0)
        for n in (1, 2, 3, 4, 5, 10, 41):
            for _ in range(50):
                c = T._kvm_counts(rng, T.TaskConfig(), n)
                self.assertEqual(sum(c), n)
                self.assertGreater(c[0], c[1])
                self.assertGreaterEqual(c[1], c[2])
                self.assertGreaterEqual(c[2], 0)

    def test_budget_binds_for_kvm(self):
        # An ideal model attends equally to the asked key's N records (the induction lookup
        # of every k a1 a2); the oracle's k chunks then hold a sample of them (equal logits,
        # ties broken at random). Its majority is the answer in all samples once k covers N
        # (6 %) and clearly less often at 1.5 %: the budget binds, whatever the selection.
        L, rng = 8192, np.random.default_rng(0)
        chunks = (L - 1) // T.CHUNK
        acc = {}
        for pct in (1.5, 6):
            k = max(1, int(round(pct / 100.0 * chunks)))
            ok = n = 0
            for s in T.eval_set(1, T.TaskConfig(words=16384), L, 16, tasks=("kvm",)):
                key = int(s.prompt[-1])
                by_chunk = {}
                for a, _ in s.spans:
                    if s.prompt[a] == key:
                        by_chunk.setdefault((a + 1) // T.CHUNK, []).append(int(s.prompt[a + 1]))
                ids = sorted(by_chunk)
                for _ in range(8):
                    seen = [w for i in rng.permutation(len(ids))[:k] for w in by_chunk[ids[i]]]
                    vals, cnt = np.unique(seen, return_counts=True)
                    top = np.sort(cnt)[::-1]
                    ok += bool((len(top) == 1 or top[0] > top[1]) and vals[np.argmax(cnt)] == s.answer[0])
                    n += 1
            acc[pct] = ok / float(n)
        self.assertEqual(acc[6], 1.0)
        self.assertLess(acc[1.5], 0.85)

    def test_existing_tasks_unchanged_by_the_hard_ones(self):
        # The hard tasks after the others leave the others' samples as they were.
        a = T.eval_set(5, T.TaskConfig(), 512, 2)
        b = T.eval_set(5, T.TaskConfig(), 512, 2, tasks=T.TASKS + T.KV_TASKS)
        self.assertEqual(len(b), len(a) + 2 * 2)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x.prompt, y.prompt)

    def test_render_text_beyond_4096_words(self):
        ws = [T.word_text(T.NUM_SPECIAL + w) for w in range(0, 20000, 7)]
        self.assertEqual(len(set(ws)), len(ws))
        self.assertEqual(T.word_text(T.NUM_SPECIAL + 5), "takaka")   # as before below 4096


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

    def test_softmax_score_normalises_each_query_head(self):
        # One KV head, two query heads, 4 chunks of 8. Query head 0 sees a logit of 5 on every
        # token and 5.5 on one token of chunk 1; query head 1 sees 0 everywhere but 3 on one
        # token of chunk 2. The raw maximum picks chunk 1 (5.5); normalised per query head,
        # chunk 2 holds the larger attention probability (0.39 against 0.05).
        n, d = 32, 4
        k = torch.zeros(n, 1, d)
        k[:, 0, 0] = 10.0
        k[8, 0, 0] = 11.0
        k[16, 0, 1] = 6.0
        q = torch.zeros(2, d)
        q[0, 0] = 1.0
        q[1, 1] = 1.0
        self.assertEqual(oracle_topk(chunk_max_logits(q, k, 4), 1), [{1}])
        s = chunk_softmax_max(q, k, 4)
        self.assertEqual(tuple(s.shape), (1, 4))
        self.assertEqual(oracle_topk(s, 1), [{2}])
        p2 = math.exp(3.0) / (31 + math.exp(3.0))      # logit 6 / sqrt(d) = 3 against 31 zeros
        self.assertAlmostEqual(float(s[0, 2]), math.log(p2), places=5)

    def test_mass_recall_weighs_what_each_unit_holds(self):
        # One KV head, one query head, 4 chunks of 8 and a tail of 8 tokens: chunk 1 holds one
        # token of logit 4 (its mass dominates), chunks 0, 2, 3 and the tail near-uniform.
        n, d = 40, 4
        k = torch.zeros(n, 1, d)
        k[12, 0, 0] = 8.0                      # q.k / sqrt(d) = 4
        k[20, 0, 0] = 0.2                      # chunk 2 a hair above chunks 0 and 3
        q = torch.zeros(1, d)
        q[0, 0] = 1.0
        m = unit_mass(q, k, 4)
        self.assertEqual(tuple(m.shape), (1, 1, 4))
        logits = group_logits(q, k)   # handed in by a caller that has them: the same results
        self.assertTrue(torch.equal(unit_mass(q, k, 4, logits=logits), m))
        self.assertTrue(torch.equal(chunk_softmax_max(q, k, 4, logits=logits), chunk_softmax_max(q, k, 4)))
        self.assertTrue(torch.equal(chunk_max_logits(q, k, 4, logits=logits), chunk_max_logits(q, k, 4)))
        z = 38 + math.exp(4.0) + math.exp(0.1)    # every prompt token, the tail's 8 included
        self.assertAlmostEqual(float(m[0, 0, 1]), (7 + math.exp(4.0)) / z, places=5)
        self.assertAlmostEqual(float(m.sum()), (z - 8) / z, places=5)
        top = oracle_topk(chunk_softmax_max(q, k, 4), 2)
        self.assertEqual(top, [{1, 2}])
        # Missing the near-tie (chunk 3 for 2) costs recall@k half and almost no mass.
        self.assertEqual(recall_at_k([{1, 3}], top, 2), 0.5)
        self.assertGreater(mass_recall([{1, 3}], top, m), 0.99)
        # Missing the chunk that holds the mass costs most of it.
        self.assertLess(mass_recall([{0, 2}], top, m), 0.3)
        self.assertAlmostEqual(mass_recall([{1, 2}], top, m), 1.0)
        self.assertEqual(mass_recall([set()], top, m), 0.0)

    def test_recall(self):
        self.assertEqual(recall_at_k([{3, 5}, {2, 6}], [{3, 5}, {6, 2}], 2), 1.0)
        self.assertEqual(recall_at_k([{3, 7}, {1, 4}], [{3, 5}, {6, 2}], 2), 0.25)
        self.assertEqual(recall_at_k([{1}, {2}], [{3}, {4}], 1), 0.0)

    def test_recall_by_layer_worst_first(self):
        # Per sample per layer -> per layer mean (layers a sample lacks are skipped) -> worst first.
        per = mean_by_layer([[0.9, 0.5, 1.0, None], [0.7, 0.3, 1.0, 0.8], [0.8, None, 1.0, 0.6]])
        for got, want in zip(per, [0.8, 0.4, 1.0, 0.7]):
            self.assertAlmostEqual(got, want)
        self.assertEqual([i for i, _ in layers_worst_first(per)], [1, 3, 0, 2])
        self.assertEqual(layers_worst_first([0.5, None, 0.5, float("nan"), 0.2]), [(4, 0.2), (0, 0.5), (2, 0.5)])
        self.assertEqual(mean_by_layer([]), [])

    def test_summary_reports_the_worst_layer(self):
        # Planted rows: layer 2 misses its chunks in both cells while the mean looks fine.
        rows = []
        for task in ("kv", "kvm"):
            for si in range(2):
                base = dict(sample=si, task=task, locality=False, k=None, answer=[1], generated=[1], steps=2,
                            select_s=None, recall=None, recall_by_layer=None)
                rows.append(dict(base, config="full", budget_pct=None, option="-", correct=1, agrees_full=None,
                                 attend_s=0.002))
                rows.append(dict(base, config="oracle", budget_pct=1.5, option="-", correct=1, agrees_full=1,
                                 attend_s=0.004))
                rows.append(dict(base, config="shadow", budget_pct=1.5, option="bf16", correct=si, agrees_full=si,
                                 recall=0.85, recall_by_layer=[1.0, 0.95, 0.5 - 0.1 * si, 0.95],
                                 mass_recall_by_layer=[1.0, 0.7, 0.99, 0.95],
                                 attend_s=0.010, select_s=0.006))
        summary = summarize(rows)
        cell = [c for c in summary if c["config"] == "shadow" and c["task"] == "kv"][0]
        self.assertAlmostEqual(cell["recall_worst_layer"], 0.45)
        self.assertEqual(cell["recall_layers_worst_first"][0][0], 2)
        self.assertAlmostEqual(cell["select_s_per_step"], 0.003)   # 2 samples x 0.006 s over 4 steps
        order = [("kv", False), ("kvm", False)]
        g = by_config(summary, order)[("shadow", 1.5, "bf16")]
        self.assertEqual([i for i, _ in g["recall_layers_worst_first"]], [2, 1, 3, 0])
        self.assertAlmostEqual(g["recall"], 0.85)
        self.assertAlmostEqual(g["pct_of_oracle"], 50.0)
        self.assertAlmostEqual(g["attend_s_per_step"], 0.005)
        self.assertIsNone(by_config(summary, order)[("full", None, "-")]["select_s_per_step"])
        md = markdown(summary, order)
        self.assertIn("worst-layer recall@k", md)
        line = [ln for ln in md.splitlines() if ln.startswith("| shadow ")][0]
        self.assertIn("0.450 (L2)", line)
        self.assertIn("L2 0.45, L1 0.95, L3 0.95, L0 1.00", line)
        self.assertIn("0.700 (L1)", line)                 # the worst layer by mass is another one
        self.assertIn("| 3.00 | 5.00 |", line)    # select and attend ms per decode step

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
        top = oracle_topk(chunk_softmax_max(q, k, 8), 2, [{0}, {0}])
        keys, vals = [], []
        for j in range(h):
            idx = [t for c in sorted({0} | top[j]) for t in range(c * 8, c * 8 + 8)] + list(range(64, n))
            keys.append(torch.cat([k[idx, j], kn[None, j]]))
            vals.append(torch.cat([v[idx, j], vn[None, j]]))
        torch.testing.assert_close(got, attend_tokens(q, keys, vals), rtol=1e-5, atol=1e-6)
        self.assertFalse(torch.allclose(got, full, atol=1e-3), "a partial budget must differ from full attention")
        # The raw-logit oracle of the earlier runs ranks with chunk_max_logits.
        raw = LocalAttend(pf, budget=2, score=chunk_max_logits).attend(0, q, kn, vn)
        top_raw = oracle_topk(chunk_max_logits(q, k, 8), 2, [{0}, {0}])
        keys = []
        vals = []
        for j in range(h):
            idx = [t for c in sorted({0} | top_raw[j]) for t in range(c * 8, c * 8 + 8)] + list(range(64, n))
            keys.append(torch.cat([k[idx, j], kn[None, j]]))
            vals.append(torch.cat([v[idx, j], vn[None, j]]))
        torch.testing.assert_close(raw, attend_tokens(q, keys, vals), rtol=1e-5, atol=1e-6)


class ShadowOptions(unittest.TestCase):
    def test_any_profile_field_is_an_option(self):
        # A field kvshade.Profile gains later (here a stand-in class) is an option as it is.
        @dataclasses.dataclass
        class FutureProfile:
            kind: str = "auto"
            sparse_budget: int = 0
            rerank_factor: int = 0
            key_signature_bits: int = 0
            recall_action: str = "default"
            keep_sink: bool = True

        fields = profile_fields(FutureProfile)
        self.assertIn("key_signature_bits", fields)
        self.assertEqual(parse_shadow_option("sig2:key_signature_bits=2,rerank_factor=4", fields),
                         ("sig2", dict(key_signature_bits=2, rerank_factor=4)))
        self.assertEqual(parse_shadow_option("g:recall_action=widen,keep_sink=false", fields),
                         ("g", dict(recall_action="widen", keep_sink=False)))
        for bad in ("nocolon", "x:no_such_field=1", "x:sparse_budget=4", "x:kind=exact", "x:rerank_factor"):
            with self.assertRaises(SystemExit):
                parse_shadow_option(bad, fields)
        self.assertEqual([option_value(v) for v in ("4", "0.9", "True", "none", "int4")], [4, 0.9, True, None, "int4"])

    def test_fields_of_the_package_profile(self):
        try:
            import kvshade
        except ImportError as e:   # the package imports without its library; skip if not
            self.skipTest("kvshade not importable: %s" % e)
        want = {f.name for f in dataclasses.fields(kvshade.Profile)}
        self.assertEqual(profile_fields(), want)
        self.assertIn("rerank_factor", want)


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
