#!/usr/bin/env python3
"""Greedy decoding of a Hugging Face transformers Llama-style model with kvshade holding its
prompt cache (kvshade.integrations.hf_cache): the prompt runs through the model once (its own attention),
its K/V go to kvshade, and every decode step attends through kvshade (select-and-reconstruct
for `shadow`). Prints each token and the running slot hit ratio (selected chunks already in
a slot / selected chunks), and with --compare the same decode with the model's DynamicCache.

Without --model a tiny random Llama (RoPE, GQA) is built, so it runs anywhere transformers
is installed; with --model PATH any local Llama-style checkpoint (and its tokenizer) is used.

    python3 client/examples/hf_generate.py --spawn build/service/kvshade-server --compare [--ucx tcp,self]
    python3 client/examples/hf_generate.py --target 127.0.0.1:50551 --model /models/Llama-3.1-8B-Instruct \\
        --prompt-file doc.txt --steps 32 --profile shadow
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import kvshade  # noqa: E402
from example_util import spawn  # noqa: E402

try:
    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
except ImportError as e:
    sys.exit("hf_generate.py needs torch and Hugging Face transformers: %s" % e)
from kvshade import hf_cache  # noqa: E402



def tiny_model(seed, device):
    """A random 2-layer Llama (4 query / 2 KV heads, head_dim 64) with O(1) activations."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    return model.to(device), None


def load_model(path, dtype, device):
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    # transformers 5 spells the dtype argument `dtype`, 4.x `torch_dtype`.
    dkw = {"dtype": dtype} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": dtype}
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=hf_cache.ATTENTION_NAME, **dkw)
    return model.to(device).eval(), tok


def greedy(model, ids, cache, steps, on_step=None):
    """Prefill then `steps` greedy tokens, one forward each (what generate does, step by step)."""
    out = []
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        for i in range(steps):
            tok = int(torch.argmax(logits))
            out.append(tok)
            if on_step:
                on_step(i, tok)
            if i + 1 < steps:
                logits = model(input_ids=torch.tensor([[tok]], device=ids.device), past_key_values=cache,
                               use_cache=True).logits[0, -1]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="127.0.0.1:50551")
    ap.add_argument("--spawn", metavar="KVSHADE_SERVER", help="start this server binary on a free port")
    ap.add_argument("--token", default=None, help="bearer token")
    ap.add_argument("--ucx", metavar="TRANSPORTS", default="",
                    help="decode calls over the UCX data plane with these UCX_TLS transports (e.g. tcp,self)")
    ap.add_argument("--model", help="local transformers checkpoint (default: a tiny random Llama)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="model dtype (default float32 for the tiny model, bfloat16 for --model)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt", help="prompt text (needs --model for its tokenizer)")
    ap.add_argument("--prompt-file", help="read the prompt text from this file")
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="random prompt length without --prompt")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--profile", default="shadow", choices=["shadow", "exact", "auto", "mini"])
    ap.add_argument("--budget", type=int, default=16, help="shadow: sparse budget (chunks per KV head per step)")
    ap.add_argument("--compare", action="store_true", help="also decode with the model's DynamicCache")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    if args.model:
        model, tok = load_model(args.model, getattr(torch, args.dtype or "bfloat16"), args.device)
    else:
        model, tok = tiny_model(args.seed, args.device)
        if args.dtype and args.dtype != "float32":
            sys.exit("the tiny model runs in float32 (casting with .to() would round its RoPE frequencies)")
    text = open(args.prompt_file).read() if args.prompt_file else args.prompt
    if text is not None:
        if tok is None:
            sys.exit("--prompt needs --model (the tiny model has no tokenizer)")
        ids = tok(text, return_tensors="pt").input_ids.to(args.device)
    else:
        g = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(3, model.config.vocab_size, (1, args.prompt_tokens), generator=g).to(args.device)
    show = (lambda t: repr(tok.decode([t]))) if tok is not None else str

    proc, target = (spawn(args.spawn, args.ucx) if args.spawn else (None, args.target))
    try:
        with kvshade.Client(target, token=args.token, use_ucx=bool(args.ucx),
                            ucx_transports=args.ucx or None) as client:
            client.wait_ready(20)
            spec = hf_cache.model_spec_from_config(model.config, "probe")
            prof = kvshade.Profile(args.profile)
            if args.profile == "shadow":
                prof.sparse_budget = args.budget
                if not args.model:  # the server's defaults (rank 160, 48 outliers) are for real models
                    prof.rank, prof.outliers = min(160, spec.num_kv_heads * spec.head_dim), 2
            hf_cache.enable(model)
            cache = hf_cache.KvShadeCache(client, model, prof, prompt_ids=ids[0],
                                          model_id=args.model or "hf-generate-tiny-%d" % args.seed)
            t0 = time.monotonic()

            def on_step(i, t):
                r = cache.hit_ratio
                print("step %3d  token %-12s  hit ratio %s" % (i, show(t), "-" if r is None else "%.3f" % r))

            print("prompt: %d tokens; profile %s" % (ids.shape[1], args.profile))
            ours = greedy(model, ids, cache, args.steps, on_step)
            dt = time.monotonic() - t0
            print("session %s: effective profile %s, %d prompt tokens reused from the prefix cache"
                  % (cache.session_id, cache.effective_profile, cache.created.reused_tokens))
            print("%d steps in %.2f s; %d of %d selected chunks were already in a slot"
                  % (args.steps, dt, cache.hits, cache.selected))
            if tok is not None:
                print("text:", repr(tok.decode(ours)))
            if args.ucx:
                print("UCX data plane: connected %s, %d fallbacks to gRPC" % (client.ucx_connected,
                                                                           client.ucx_fallbacks))
            cache.close(close_session=True)
            if args.compare:
                model.set_attn_implementation("sdpa")
                ref = greedy(model, ids, DynamicCache(), args.steps)
                same = sum(a == b for a, b in zip(ours, ref))
                print("DynamicCache: %d of %d tokens equal%s" % (same, args.steps, "" if same == args.steps else
                                                                 " (first difference at step %d)"
                                                                 % next(i for i, (a, b) in enumerate(zip(ours, ref))
                                                                        if a != b)))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
