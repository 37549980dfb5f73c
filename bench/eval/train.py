#!/usr/bin/env python3
"""Trains the evaluation model (model.EvalLM) on the tasks of tasks.py.

Every batch mixes the three tasks, with and without chunk locality; each sequence asks
every question of its context (tasks.make_train_sequence, with 1..8 needles and 1..4 hops
so that easy cases teach the lookup first) and the loss is the cross entropy of the answer
tokens only. A curriculum over lengths (default 64, 256, 1024, 2048 then 8192 tokens:
20/20/20/10/30 % of the steps: the lookup is learnt on short contexts, then carried to long
ones) at a constant number of tokens per step (65536), AdamW (lr 2e-3), linear warm-up
then cosine decay, bf16 autocast on CUDA; batches are made by worker processes, each from
(seed, step) alone.

  python3 bench/eval/train.py --out bench/eval/weights/evallm.pt              # H200, <= 6 min
  python3 bench/eval/train.py --out /tmp/smoke.pt --smoke                     # CPU, about a minute
  python3 bench/eval/train.py --out W.pt --tasks rep,kv,kvm --words 8448      # the hard model

--tasks picks the tasks of the batches (uniformly; repeat a name to weight it, e.g.
kv,kv,kvm). The hard tasks (tasks.KV_TASKS: span retrieval and majority span over distinct
random words) want a vocabulary at least as large as the longest context (--words 8448:
an 8K context of distinct words); rep (training only) teaches their lookup densely; the model's vocabulary follows --words, and the harness
takes it back from the weights.

--steps auto (the default on CUDA) times a few forward/backward passes at each length first
and picks the number of steps that fits --budget-s; the number chosen is logged and saved
in the weights' meta, and --steps N with the same seed repeats the run (same data, same
initialisation; up to the GPU kernels' own nondeterminism). A run past 115 % of --budget-s
stops early (meta: steps_run < steps) rather than overrun the GPU machine's time.
"""
import argparse
import contextlib
import json
import math
import multiprocessing
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tasks as T  # noqa: E402
from model import EvalLM, ModelConfig, save  # noqa: E402


DEFAULT_CURRICULUM = "64:0.2,256:0.2,1024:0.2,2048:0.1,8192:0.3"


def parse_curriculum(s):
    """"512:0.35,2048:0.3,8192:0.35" -> [(512, 0.35), ...]"""
    out = []
    for part in s.split(","):
        n, f = part.split(":")
        out.append((int(n), float(f)))
    tot = sum(f for _, f in out)
    return [(n, f / tot) for n, f in out]


def make_batch(seed, step, cfg, length, bsz, task_set=T.TASKS):
    """The batch of one step, from (seed, step) alone: the same whichever process makes it."""
    rng = np.random.default_rng([seed, step])
    toks, masks = [], []
    for _ in range(bsz):
        task = task_set[int(rng.integers(len(task_set)))]
        t, m = T.make_train_sequence(rng, cfg, task, length, bool(rng.integers(2)))
        toks.append(t)
        masks.append(m)
    return np.stack(toks), np.stack(masks)


def _make_batch_args(args):
    return make_batch(*args)


def to_device(b, device):
    return (torch.from_numpy(b[0]).to(device, non_blocking=True),
            torch.from_numpy(b[1]).to(device, non_blocking=True))


def batch(rng, cfg, length, bsz, device, task_set=T.TASKS):
    return to_device(make_batch(int(rng.integers(1 << 31)), 0, cfg, length, bsz, task_set), device)


def loss_fn(model, toks, masks, amp):
    """Cross entropy of the answer tokens: position i predicts token i+1 where mask[i+1]."""
    with (torch.autocast("cuda", dtype=torch.bfloat16) if amp else contextlib.nullcontext()):
        c = model.c
        n = toks.shape[1]
        from model import rope_cos_sin, causal_attention
        cos, sin = rope_cos_sin(torch.arange(n), c.head_dim, c.rope_theta, toks.device)
        x = model.embed(toks)
        for b in model.blocks:
            q, _, k, v = b.qkv(x, cos, sin)
            x = x + b.wo(causal_attention(q, k, v).flatten(-2))
            x = x + b.mlp(x)
        sel = masks[:, 1:]
        h = x[:, :-1][sel]
        logits = model.head(model.norm(h)).float()
    tgt = toks[:, 1:][sel]
    loss = F.cross_entropy(logits, tgt)
    acc = (logits.argmax(-1) == tgt).float().mean()
    return loss, acc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="weights file (.pt)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--smoke", action="store_true", help="tiny model and lengths, a few CPU-minutes at most")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", default="auto", help="number of steps, or auto (fit --budget-s)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="training time for --steps auto")
    ap.add_argument("--curriculum", default=None, help="length:fraction,... (default %s)" % DEFAULT_CURRICULUM)
    ap.add_argument("--batch-tokens", type=int, default=None, help="tokens per step (default 65536)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--workers", type=int, default=None, help="data processes (default: CPUs - 2, at most 14)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--d-model", type=int, default=None)
    ap.add_argument("--tasks", default=",".join(T.TASKS),
                    help="comma-separated, of %s (default %s)" % (", ".join(T.ALL_TASKS), ",".join(T.TASKS)))
    ap.add_argument("--words", type=int, default=1024, help="synthetic vocabulary (words after the markers)")
    ap.add_argument("--train-needles", type=int, default=8, help="mk records per training sequence (eval: 4)")
    ap.add_argument("--train-kv-records", type=int, default=16, help="kv records per training sequence (eval: 8)")
    ap.add_argument("--log", default=None, help="JSON lines of the training curve")
    a = ap.parse_args(argv)

    torch.manual_seed(a.seed)
    tcfg = T.TaskConfig(words=a.words, n_needles=a.train_needles, kv_records=a.train_kv_records, vary=True)
    train_tasks = tuple(a.tasks.split(","))
    unknown = [t for t in train_tasks if t not in T.ALL_TASKS + T.TRAIN_ONLY]
    if unknown:
        ap.error("--tasks: unknown task(s) %s (known: %s)" % (", ".join(unknown),
                                                              ", ".join(T.ALL_TASKS + T.TRAIN_ONLY)))
    if a.smoke:
        mcfg = ModelConfig(vocab=tcfg.vocab, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                           ffn=384)
        curriculum = parse_curriculum(a.curriculum or "64:0.5,256:0.5")
        batch_tokens = a.batch_tokens or 2048
        steps = 24 if a.steps == "auto" else int(a.steps)
        warmup = min(a.warmup, 10)
    else:
        mcfg = ModelConfig(vocab=tcfg.vocab)
        curriculum = parse_curriculum(a.curriculum or DEFAULT_CURRICULUM)
        batch_tokens = a.batch_tokens or 65536
        steps = None if a.steps == "auto" else int(a.steps)
        warmup = a.warmup
    if a.layers:
        mcfg.n_layers = a.layers
    if a.d_model:
        mcfg.d_model = a.d_model
    dev = torch.device(a.device)
    amp = dev.type == "cuda"
    if amp:
        torch.backends.cuda.matmul.allow_tf32 = True
    model = EvalLM(mcfg).to(dev)
    params = sum(p.numel() for p in model.parameters())
    print("model: %s, %.2fM parameters, device %s" % (mcfg, params / 1e6, dev), flush=True)

    t_start = time.time()
    if steps is None:
        # Time forward+backward at each length (no update: the model is untouched).
        per = []
        trng = np.random.default_rng(a.seed + 999)
        n_workers = a.workers if a.workers is not None else max(1, min(14, (os.cpu_count() or 2) - 2))
        for length, _ in curriculum:
            bsz = max(1, batch_tokens // length)
            td = time.time()
            toks, masks = batch(trng, tcfg, length, bsz, dev, train_tasks)
            t_data = (time.time() - td) * 1.25 / n_workers   # the workers make batches in parallel
            ts = []
            for i in range(3):
                if amp:
                    torch.cuda.synchronize()
                t0 = time.time()
                loss, _ = loss_fn(model, toks, masks, amp)
                loss.backward()
                model.zero_grad(set_to_none=True)
                if amp:
                    torch.cuda.synchronize()
                ts.append(time.time() - t0)
            per.append(max(min(ts[1:]) * 1.08 + 0.002, t_data))   # + optimizer step; or data-bound
        budget = a.budget_s - (time.time() - t_start)
        steps = max(1, int(budget / sum(f * t for (_, f), t in zip(curriculum, per))))
        print("auto steps: %d (seconds per step by length: %s; budget %.0f s)" % (
            steps, ", ".join("%d: %.3f" % (n, t) for (n, _), t in zip(curriculum, per)), budget), flush=True)
    torch.manual_seed(a.seed)
    model = EvalLM(mcfg).to(dev)   # the same initialisation whatever the timing pass did
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            **({"fused": True} if amp else {}))
    bounds, acc_f = [], 0.0
    for length, f in curriculum:
        acc_f += f
        bounds.append((int(round(acc_f * steps)), length))
    def length_at(step):
        return next((n for b, n in bounds if step < b), bounds[-1][1])

    plan = [(a.seed, step, tcfg, length_at(step), max(1, batch_tokens // length_at(step)), train_tasks)
            for step in range(steps)]
    workers = a.workers if a.workers is not None else max(1, min(14, (os.cpu_count() or 2) - 2))
    pool = multiprocessing.get_context("fork").Pool(workers) if workers > 1 else None
    batches = pool.imap(_make_batch_args, plan, chunksize=1) if pool else map(_make_batch_args, plan)
    log = open(a.log, "w") if a.log else None
    planned = steps
    t0 = time.time()
    ema = None
    for step in range(steps):
        length = length_at(step)
        lr = a.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        toks, masks = to_device(next(batches), dev)
        if a.steps == "auto" and not a.smoke and time.time() - t_start > a.budget_s * 1.15:
            print("stopping early at step %d: past 115%% of --budget-s" % step, flush=True)
            steps = step
            break
        loss, acc = loss_fn(model, toks, masks, amp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0 or step == steps - 1:
            lv, av = loss.item(), acc.item()
            ema = av if ema is None else 0.7 * ema + 0.3 * av
            rec = dict(step=step, length=length, loss=round(lv, 4), answer_token_acc=round(av, 4),
                       lr=round(lr, 6), s=round(time.time() - t0, 1))
            print(json.dumps(rec), flush=True)
            if log:
                log.write(json.dumps(rec) + "\n")
    train_s = time.time() - t0
    if pool:
        pool.terminate()
    meta = dict(seed=a.seed, steps=planned, steps_run=steps, curriculum=curriculum, batch_tokens=batch_tokens, lr=a.lr,
                warmup=warmup, smoke=a.smoke, train_seconds=round(train_s, 1),
                total_seconds=round(time.time() - t_start, 1), final_answer_token_acc=ema,
                tasks=list(train_tasks),
                task_config=dict(words=tcfg.words, n_needles=tcfg.n_needles, hops=tcfg.hops,
                                 kv_records=tcfg.kv_records, kvm_share=tcfg.kvm_share, kvm_gap=tcfg.kvm_gap),
                device=str(torch.cuda.get_device_name(0)) if amp else "cpu", torch=torch.__version__)
    save(model, a.out, meta)
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump(dict(config=vars(mcfg) if hasattr(mcfg, "__dict__") else {}, meta=meta), f, indent=1)
    print("saved %s after %d steps in %.0f s" % (a.out, steps, train_s), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
