"""RULER-style synthetic tasks over a synthetic vocabulary, for the selection-fidelity evaluation.

Three tasks, each rendered with or without chunk locality (a chunk = CHUNK = 8 consecutive
tokens, the unit kvshade selects), and two hard ones, only without (KV_TASKS, below):

  mk  multi-key needle retrieval: `n_needles` records KEY k v1 v2 END (distinct keys k)
      hidden in filler; the question Q k asks for v1 v2 (2 answer tokens).
  vt  variable tracking: `hops` records VAR x1 N, VAR x2 x1, ..., VAR xh x(h-1) ("xi takes
      the value of x(i-1)", x1 takes the value N), in that order, interleaved with a
      distractor chain; the question QVAR xh asks for the chain back to its value:
      x(h-1) ... x1 N (h answer tokens; each decoded token is one more lookup).
  fw  aggregation (frequent words): records ITEM w, w one of 3 candidate words with
      distinct counts; the question QFREQ ANS asks for the most frequent one (1 token).

The answer of mk and vt directly follows the token that names what to look up (an
induction pattern: find that token earlier in the context, copy what follows it), the
easiest form for a small model to learn.

With locality the filler is made of chunk-aligned runs of 8 tokens drawn from one topic
(16 related words) and every record starts a chunk (padded with its chunk's topic words),
so a chunk's mean key represents its tokens. Without locality the filler is i.i.d. over
the whole vocabulary and records start at any offset, straddling chunk boundaries.

The hard tasks (KV_TASKS) hide records in a context of distinct random words: no markers,
no topics, every context word drawn without replacement where the vocabulary allows (with
fewer words than context tokens the filler cycles through permutations of the words no
record uses, so that record words still occur only where the records put them):

  kv  key-value span retrieval: `kv_records` records k s1 .. sm (distinct keys, spans of 2-4
      words), each at any offset (records straddle chunk boundaries); the question Qm k asks
      for the m words that follow k. The other records are distractors, and since nothing
      marks a record, so is every other word: the chunk holding k is 8 unrelated words.
  kvm majority span: the asked key occurs in N records k a1 a2 / k b1 b2 / k c1 c2 (N about
      kvm_share of the prompt's chunks: 41 at 8K), with distinct counts, among a distractor
      key's as many; Q2 k asks for the span that follows k most often. One decode step needs
      all N records, each in its own chunk: a budget of fewer chunks than N sees a sample
      of them, so even the oracle chunk choice loses accuracy at 1.5 % (15 chunks at 8K)
      and keeps it at 6 % (61).

Token ids: 0..NUM_SPECIAL-1 are the markers below, words are NUM_SPECIAL..NUM_SPECIAL+words-1.
Everything is drawn from a numpy Generator: the same seed gives the same samples.
"""
from dataclasses import dataclass, field
from typing import List, Tuple

import numpy as np

PAD, BOS, KEY, IS, END, Q, ANS, VAR, EQ, QVAR, ITEM, QFREQ, EOS, Q2, Q3, Q4 = range(16)
NUM_SPECIAL = 16
SPECIAL_NAMES = {PAD: "<pad>", BOS: "<s>", KEY: "KEY", IS: "IS", END: "END", Q: "Q", ANS: "ANS",
                 VAR: "VAR", EQ: "=", QVAR: "QVAR", ITEM: "ITEM", QFREQ: "QFREQ", EOS: "</s>",
                 Q2: "Q2", Q3: "Q3", Q4: "Q4"}
SPAN_QUESTION = {2: Q2, 3: Q3, 4: Q4}           # Qm k: the m words that follow k (most often)
SPAN_LENGTH = {q: m for m, q in SPAN_QUESTION.items()}
CHUNK = 8
TOPIC = 16          # words per topic (locality filler)
TASKS = ("mk", "vt", "fw")
KV_TASKS = ("kv", "kvm")   # distinct random words, no chunk locality
ALL_TASKS = TASKS + KV_TASKS
TRAIN_ONLY = ("rep",)      # make_train_sequence only (see _train_rep)


@dataclass
class TaskConfig:
    words: int = 1024          # synthetic word types
    n_needles: int = 4         # mk: records (and distinct keys)
    hops: int = 4              # vt: variables in a chain (answer: hops tokens, see above)
    fw_top: Tuple[int, int] = (10, 16)   # fw: count range of the most frequent word
    fw_gap: Tuple[int, int] = (3, 6)     # fw: count difference to the next one
    kv_records: int = 8        # kv: records (distinct keys)
    kv_span: Tuple[int, int] = (2, 4)    # kv: words per answer span
    kvm_share: float = 0.04    # kvm: records of the asked key per chunk of the prompt (41 at 8K)
    kvm_gap: float = 0.1       # kvm: least count difference of the first two spans, share of N
    vary: bool = False         # training: 1..n_needles needles, 1..hops hops, 1..kv_records records
                               # and 1..N kvm records per sequence

    @property
    def vocab(self):
        return NUM_SPECIAL + self.words


@dataclass
class Sample:
    """One prompt (BOS, context, first question) and its answer; `qa` holds every question
    of the context (training asks all of them) as (question tokens, answer tokens)."""
    task: str
    locality: bool
    prompt: np.ndarray                  # int64 [n]
    answer: np.ndarray                  # int64 [m]
    qa: List[Tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    spans: List[Tuple[int, int]] = field(default_factory=list)   # [start, end) of records in prompt


def _words(rng, cfg, k, exclude=()):
    """k distinct word ids, none in exclude."""
    ex = set(int(e) for e in exclude)
    out = []
    while len(out) < k:
        w = int(rng.integers(NUM_SPECIAL, NUM_SPECIAL + cfg.words))
        if w not in ex:
            ex.add(w)
            out.append(w)
    return out


def _filler(rng, cfg, n, locality, offset):
    """n filler tokens that start at absolute position `offset`. With locality every chunk
    (aligned to absolute multiples of CHUNK) draws from one topic."""
    if not locality:
        return rng.integers(NUM_SPECIAL, NUM_SPECIAL + cfg.words, n)
    if n <= 0:
        return np.zeros(0, np.int64)
    chunk = (offset + np.arange(n)) // CHUNK
    chunk -= chunk[0]
    topics = rng.integers(0, cfg.words // TOPIC, int(chunk[-1]) + 1)
    return NUM_SPECIAL + topics[chunk] * TOPIC + rng.integers(0, TOPIC, n)


def _place(rng, cfg, ctx_len, records, locality, start_pos):
    """Lays `records` (lists of token ids, in the given order) into a context of ctx_len
    tokens starting at absolute position start_pos, at random positions, order kept.
    Returns (tokens, spans with absolute positions)."""
    recs = [list(r) for r in records]
    if locality:   # each record fills whole chunks: pad with its chunk's topic words
        padded = []
        for r in recs:
            pad = (-len(r)) % CHUNK
            t = int(rng.integers(cfg.words // TOPIC))
            padded.append((r, list(NUM_SPECIAL + t * TOPIC + rng.integers(0, TOPIC, pad))))
        first = (-start_pos) % CHUNK
        slots = (ctx_len - first) // CHUNK
        need = sum((len(r) + len(p)) // CHUNK for r, p in padded)
        if need > slots:
            raise ValueError("context of %d tokens too short for the records" % ctx_len)
        # Choose distinct chunk slots for the records, in order: gaps[i] = free
        # chunks before record i.
        free = slots - need
        gaps = np.sort(rng.integers(0, free + 1, len(padded)))
        out, spans = [_filler(rng, cfg, first, True, start_pos)], []
        pos = start_pos + first
        used_free = 0
        for (r, p), g in zip(padded, gaps):
            n_free = int(g) - used_free
            used_free = int(g)
            out.append(_filler(rng, cfg, n_free * CHUNK, True, pos))
            pos += n_free * CHUNK
            spans.append((pos, pos + len(r)))
            out.append(np.asarray(r + p, np.int64))
            pos += len(r) + len(p)
        rest = start_pos + ctx_len - pos
        out.append(_filler(rng, cfg, rest, True, pos))
        return np.concatenate(out), spans
    total = sum(len(r) for r in recs)
    free = ctx_len - total
    if free < 0:
        raise ValueError("context of %d tokens too short for the records" % ctx_len)
    gaps = np.sort(rng.integers(0, free + 1, len(recs)))
    out, spans = [], []
    pos, used_free = start_pos, 0
    for r, g in zip(recs, gaps):
        n_free = int(g) - used_free
        used_free = int(g)
        out.append(_filler(rng, cfg, n_free, False, pos))
        pos += n_free
        spans.append((pos, pos + len(r)))
        out.append(np.asarray(r, np.int64))
        pos += len(r)
    out.append(_filler(rng, cfg, start_pos + ctx_len - pos, False, pos))
    return np.concatenate(out), spans


def _records_mk(rng, cfg, length):
    top = max(1, min(cfg.n_needles, length // 24))     # short contexts hold fewer records
    n = top if not cfg.vary else int(rng.integers(1, top + 1))
    keys = _words(rng, cfg, n)
    vals = [_words(rng, cfg, 2) for _ in range(n)]
    recs = [[KEY, k, v[0], v[1], END] for k, v in zip(keys, vals)]
    order = rng.permutation(n)
    qa = [(np.array([Q, keys[i]]), np.array(vals[i])) for i in order]
    return recs, qa


def _records_vt(rng, cfg, length):
    recs_by_chain, qa = [], []
    used = []
    top = max(1, min(cfg.hops, length // 40))
    hops = top if not cfg.vary else int(rng.integers(1, top + 1))
    for _ in range(2):                      # the asked chain and a distractor
        names = _words(rng, cfg, hops + 1, exclude=used)
        used += names
        value, xs = names[0], names[1:]
        recs = [[VAR, xs[0], value]] + [[VAR, xs[i], xs[i - 1]] for i in range(1, len(xs))]
        recs_by_chain.append(recs)
        qa.append((np.array([QVAR, xs[-1]]), np.array(list(reversed(xs[:-1])) + [value])))
    # Interleave the two chains, each in its own order (a definition precedes its use).
    a, b = recs_by_chain
    pick = rng.permutation([0] * len(a) + [1] * len(b))
    ia = ib = 0
    recs = []
    for p in pick:
        if p == 0:
            recs.append(a[ia]); ia += 1
        else:
            recs.append(b[ib]); ib += 1
    return recs, qa


def _records_fw(rng, cfg, length):
    cand = _words(rng, cfg, 3)
    if length < 96:      # the shortest curriculum contexts: 3 against 2
        counts = [3, 2, 0]
    else:
        c1 = int(rng.integers(cfg.fw_top[0], cfg.fw_top[1] + 1))
        c2 = c1 - int(rng.integers(cfg.fw_gap[0], cfg.fw_gap[1] + 1))
        c3 = c2 - int(rng.integers(cfg.fw_gap[0], cfg.fw_gap[1] + 1))
        # Short contexts get fewer items: at most a quarter of the context's chunks.
        cap = max(6, length // (4 * CHUNK))
        if c1 + c2 + c3 > cap:
            f = cap / float(c1 + c2 + c3)
            c1, c2, c3 = max(3, int(c1 * f)), int(c2 * f), int(c3 * f)
        c2 = max(2, min(c2, c1 - 1))             # strict order, every word at least once
        c3 = max(1, min(c3, c2 - 1))
        counts = [c1, c2, c3]
    items = [w for w, c in zip(cand, counts) for _ in range(c)]
    items = [items[i] for i in rng.permutation(len(items))]
    recs = [[ITEM, w] for w in items]
    return recs, [(np.array([QFREQ, ANS]), np.array([cand[0]]))]


def _records_kv(rng, cfg, length):
    top = max(1, min(cfg.kv_records, length // 16))
    n = top if not cfg.vary else int(rng.integers(1, top + 1))
    spans = [int(rng.integers(cfg.kv_span[0], cfg.kv_span[1] + 1)) for _ in range(n)]
    words = _words(rng, cfg, n + sum(spans))
    keys, recs, qa, i = words[:n], [], [], n
    for k, m in zip(keys, spans):
        recs.append([k] + words[i:i + m])
        i += m
    order = rng.permutation(n)
    qa = [(np.array([SPAN_QUESTION[spans[j]], keys[j]]), np.array(recs[j][1:])) for j in order]
    return recs, qa


def kvm_records(length, cfg):
    """kvm: records of the asked key at this prompt length (as many again for the distractor)."""
    return max(3, int(round(cfg.kvm_share * length / CHUNK)))


def _kvm_counts(rng, cfg, n):
    """Counts c1 > c2 >= c3 >= 0 of the three spans, summing to n, c1 - c2 >= kvm_gap * n."""
    if n == 1:
        return [1, 0, 0]
    g0 = max(1, int(round(cfg.kvm_gap * n)))
    gap = min(n, g0 + int(rng.integers(0, g0 + 1)))
    if n - gap == 1:                     # 2 c2 + c3 = 1 has no solution with c3 <= c2
        gap = gap - 1 if gap > 1 else gap + 1
    rest = n - gap
    lo, hi = -(-rest // 3), rest // 2     # c3 = rest - 2 c2 in [0, c2]
    c2 = int(rng.integers(lo, hi + 1))
    return [c2 + gap, c2, rest - 2 * c2]


def _records_kvm(rng, cfg, length):
    top = kvm_records(length, cfg)
    n = top if not cfg.vary else int(rng.integers(1, top + 1))
    words = _words(rng, cfg, 2 * (1 + 3 * 2))
    recs, qa = [], []
    for j in range(2):                   # the asked key and a distractor key
        key, w = words[7 * j], words[7 * j + 1:7 * j + 7]
        cand = [w[0:2], w[2:4], w[4:6]]
        counts = _kvm_counts(rng, cfg, n)
        recs += [[key] + c for c, m in zip(cand, counts) for _ in range(m)]
        qa.append((np.array([Q2, key]), np.array(cand[0])))
    recs = [recs[i] for i in rng.permutation(len(recs))]
    return recs, qa


RECORDS = {"mk": _records_mk, "vt": _records_vt, "fw": _records_fw, "kv": _records_kv, "kvm": _records_kvm}


def task_localities(task):
    """The localities a task comes with: the KV_TASKS only without."""
    return (False,) if task in KV_TASKS else (True, False)


def _distinct_filler(rng, cfg, n, reserved):
    """n words, none in reserved, drawn without replacement; past the vocabulary, cycling
    through permutations of it (each word then at most ceil(n / available) times)."""
    keep = np.ones(cfg.words, bool)
    keep[np.asarray(sorted(reserved), np.int64) - NUM_SPECIAL] = False
    pool = NUM_SPECIAL + np.flatnonzero(keep)
    if len(pool) == 0:
        raise ValueError("no words left for the filler")
    out = []
    while n > 0:
        take = min(n, len(pool))
        out.append(rng.choice(pool, take, replace=False))
        n -= take
    return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)


def _place_distinct(rng, cfg, ctx_len, records, start_pos):
    """Lays `records` (lists of word ids, in order) at random offsets of a context of distinct
    random words (_distinct_filler, none of the records' words). Returns (tokens, spans)."""
    recs = [list(r) for r in records]
    total = sum(len(r) for r in recs)
    free = ctx_len - total
    if free < 0:
        raise ValueError("context of %d tokens too short for the records" % ctx_len)
    filler = _distinct_filler(rng, cfg, free, {w for r in recs for w in r})
    gaps = np.sort(rng.integers(0, free + 1, len(recs)))
    out, spans = [], []
    pos, used = start_pos, 0
    for r, g in zip(recs, gaps):
        out.append(filler[used:int(g)])
        pos += int(g) - used
        used = int(g)
        spans.append((pos, pos + len(r)))
        out.append(np.asarray(r, np.int64))
        pos += len(r)
    out.append(filler[used:])
    return np.concatenate(out), spans


def _context(rng, cfg, task, ctx_len, recs, locality, start_pos):
    if task in KV_TASKS:
        return _place_distinct(rng, cfg, ctx_len, recs, start_pos)
    return _place(rng, cfg, ctx_len, recs, locality, start_pos)


def make_sample(rng, cfg: TaskConfig, task: str, length: int, locality: bool) -> Sample:
    """A prompt of exactly `length` tokens: BOS, the context, the first question. The
    KV_TASKS have no chunk locality whatever `locality` says (Sample.locality False)."""
    recs, qa = RECORDS[task](rng, cfg, length)
    locality = bool(locality) and task not in KV_TASKS
    q0 = qa[0][0]
    ctx_len = length - 1 - len(q0)
    ctx, spans = _context(rng, cfg, task, ctx_len, recs, locality, start_pos=1)
    prompt = np.concatenate([[BOS], ctx, q0]).astype(np.int64)
    assert len(prompt) == length
    return Sample(task, locality, prompt, qa[0][1].astype(np.int64), qa, spans)


def make_train_sequence(rng, cfg: TaskConfig, task: str, length: int, locality: bool):
    """A training sequence of exactly `length` tokens: BOS, context, then every question of
    the context with its answer. Returns (tokens [length], loss mask [length]: True where
    the token is an answer token, i.e. the target of the previous position)."""
    if task == "rep":
        return _train_rep(rng, cfg, length)
    recs, qa = RECORDS[task](rng, cfg, length)
    tail = sum(len(q) + len(a) for q, a in qa)
    ctx, _ = _context(rng, cfg, task, length - 1 - tail, recs, locality, start_pos=1)
    toks, mask = [np.array([BOS]), ctx], [np.zeros(1 + len(ctx), bool)]
    for q, a in qa:
        toks += [q, a]
        mask += [np.zeros(len(q), bool), np.ones(len(a), bool)]
    toks, mask = np.concatenate(toks).astype(np.int64), np.concatenate(mask)
    assert len(toks) == length
    return toks, mask


def _train_rep(rng, cfg, length):
    """Training only ("rep"): BOS, distinct random words, EQ, then the context again from a
    random word on to the end of the sequence, every copied word after the first an answer:
    the lookup kv asks (the word that followed the current one), 2/5 of the sequence long, for the first steps of a curriculum to learn it from."""
    c = (3 * length) // 5
    r = length - 2 - c
    ctx = _distinct_filler(rng, cfg, c, ())
    j = int(rng.integers(0, c - r + 1))
    toks = np.concatenate([[BOS], ctx, [EQ], ctx[j:j + r]]).astype(np.int64)
    mask = np.zeros(length, bool)
    mask[c + 3:] = True
    assert len(toks) == length
    return toks, mask


def eval_set(seed: int, cfg: TaskConfig, length: int, per_cell: int, tasks=TASKS, localities=(True, False)):
    """The fixed evaluation set: per_cell samples per (task, locality), from `seed`; a task
    gets the localities it comes with (the KV_TASKS: only without)."""
    out = []
    for ti, task in enumerate(tasks):
        for li, loc in enumerate(localities):
            if loc not in task_localities(task):
                continue
            rng = np.random.default_rng([seed, ti, li, length])
            out += [make_sample(rng, cfg, task, length, loc) for _ in range(per_cell)]
    return out


# --- Reference solutions (what the answers must be), used by the tests ---

def solve(prompt) -> List[int]:
    """Answers the prompt's question from its tokens alone, by the task's definition."""
    p = [int(t) for t in prompt]
    if p[-2] == Q:
        key = p[-1]
        for i in range(len(p) - 5):
            if p[i] == KEY and p[i + 1] == key:
                return [p[i + 2], p[i + 3]]
        raise ValueError("no needle for the key")
    if p[-2] == QVAR:
        defs = {}
        for i in range(len(p) - 4):
            if p[i] == VAR:
                defs[p[i + 1]] = p[i + 2]
        out, x = [], p[-1]
        while x in defs:
            x = defs[x]
            out.append(x)
        return out
    if p[-2] in SPAN_LENGTH:   # Qm k: the m words that follow k most often (kv: k once)
        key, m = p[-1], SPAN_LENGTH[p[-2]]
        counts = {}
        for i in range(len(p) - 2 - m):
            if p[i] == key:
                span = tuple(p[i + 1:i + 1 + m])
                counts[span] = counts.get(span, 0) + 1
        if not counts:
            raise ValueError("no record for the key")
        best = sorted(counts.items(), key=lambda kv: -kv[1])
        if len(best) > 1 and best[0][1] == best[1][1]:
            raise ValueError("tie")
        return list(best[0][0])
    if p[-2] == QFREQ and p[-1] == ANS:
        counts = {}
        for i in range(len(p) - 3):
            if p[i] == ITEM:
                counts[p[i + 1]] = counts.get(p[i + 1], 0) + 1
        best = sorted(counts.items(), key=lambda kv: -kv[1])
        if len(best) > 1 and best[0][1] == best[1][1]:
            raise ValueError("tie")
        return [best[0][0]]
    raise ValueError("no question at the end of the prompt")


# --- Text rendering, for models with their own tokenizer (Hugging Face directories) ---

_SYL = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "vo", "pe", "du", "ga", "zi", "ho", "be", "fu", "ja"]


def word_text(tok: int) -> str:
    if tok < NUM_SPECIAL:
        return SPECIAL_NAMES.get(tok, "<%d>" % tok)
    w = tok - NUM_SPECIAL
    s = ""
    for _ in range(3):
        s += _SYL[w % 16]
        w //= 16
    while w:            # past 4096 words: one more syllable per base-16 digit
        s += _SYL[w % 16]
        w //= 16
    return s


def render_text(tokens) -> str:
    """Space-separated words; BOS is left to the tokenizer."""
    return " ".join(word_text(int(t)) for t in tokens if int(t) != BOS)
