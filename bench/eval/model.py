"""The evaluation model (a small RoPE + GQA decoder) and the backbones the harness decodes.

`EvalLM` is a Llama-style decoder: token embedding, `n_layers` blocks of RMSNorm ->
attention (RoPE, half-split pairing as Hugging Face Llama, GQA) -> RMSNorm -> SwiGLU, a
final RMSNorm and the output head. Training runs `forward` (whole sequences, causal).

A backbone is what the harness needs from a model, whoever made it:
  spec(model_id)   -> kvshade.ModelSpec
  prefill(ids)     -> Prefill: per layer pre-RoPE keys, post-RoPE keys, values [n, h, d] and
                      the last `obs` post-RoPE queries [obs, hq, d], float32 rounded to bf16
                      (what kvshade stores), and the last position's logits
  step(tok, pos, attend) -> logits [vocab] of one decode step; per layer it calls
                      attend(layer, q [hq, d], k [h, d], v [h, d]) (q, k post-RoPE, bf16-
                      rounded) and uses the [hq, d] it returns as the attention output.
`OwnBackbone` wraps EvalLM; `HFBackbone` drives a Hugging Face Llama-style model's modules
(Llama, Mistral, Qwen2, Qwen3) the same way.
"""
import json
import math
import os
from dataclasses import asdict, dataclass
from typing import List

import torch
import torch.nn.functional as F

HAS_SDPA = hasattr(F, "scaled_dot_product_attention")


@dataclass
class ModelConfig:
    vocab: int = 1040
    d_model: int = 512
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 64
    ffn: int = 1536
    rope_theta: float = 100000.0
    norm_eps: float = 1e-5
    tied: bool = True          # output head = embedding (copying a token is then easy to learn)


def bf16r(x):
    """Rounds to bf16 and back to float32 (kvshade keeps K and V in bf16)."""
    return x.to(torch.bfloat16).float()


def rope_cos_sin(pos, head_dim, theta, device):
    """cos, sin [n, head_dim/2] in float32, computed in float64."""
    half = head_dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, half, dtype=torch.float64, device=device) * 2 / head_dim))
    ang = pos.to(device=device, dtype=torch.float64)[:, None] * inv[None]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x, cos, sin):
    """Half-split RoPE. x [..., n, heads, d]; cos, sin [n, d/2]."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)


class RMSNorm(torch.nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight.to(x.dtype)


class Block(torch.nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.n1 = RMSNorm(c.d_model, c.norm_eps)
        self.wq = torch.nn.Linear(c.d_model, c.n_heads * c.head_dim, bias=False)
        self.wk = torch.nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.wv = torch.nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.wo = torch.nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=False)
        self.n2 = RMSNorm(c.d_model, c.norm_eps)
        self.w1 = torch.nn.Linear(c.d_model, c.ffn, bias=False)
        self.w3 = torch.nn.Linear(c.d_model, c.ffn, bias=False)
        self.w2 = torch.nn.Linear(c.ffn, c.d_model, bias=False)

    def qkv(self, x, cos, sin):
        """x [..., n, d_model] -> q [..., n, hq, d] and k [..., n, h, d] post-RoPE, k pre-RoPE, v."""
        c = self.c
        h = self.n1(x)
        q = self.wq(h).unflatten(-1, (c.n_heads, c.head_dim))
        k = self.wk(h).unflatten(-1, (c.n_kv_heads, c.head_dim))
        v = self.wv(h).unflatten(-1, (c.n_kv_heads, c.head_dim))
        return apply_rope(q, cos, sin), k, apply_rope(k, cos, sin), v

    def mlp(self, x):
        h = self.n2(x)
        return self.w2(F.silu(self.w1(h)) * self.w3(h))


def causal_attention(q, k, v, block=1024):
    """q [B, n, hq, d], k, v [B, n, h, d] -> [B, n, hq, d]; causal, GQA. SDPA where torch
    has it, else blocks of queries (CPU, torch 1.x)."""
    g = q.shape[2] // k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    kt, vt = kt.repeat_interleave(g, dim=1), vt.repeat_interleave(g, dim=1)
    if HAS_SDPA:
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)
    n, d = q.shape[1], q.shape[-1]
    out = torch.empty_like(qt)
    for s in range(0, n, block):
        e = min(n, s + block)
        sc = (qt[:, :, s:e] @ kt[:, :, :e].transpose(-1, -2)) / math.sqrt(d)
        mask = torch.arange(e, device=q.device)[None, :] > torch.arange(s, e, device=q.device)[:, None]
        sc = sc.masked_fill(mask, float("-inf"))
        out[:, :, s:e] = torch.softmax(sc.float(), dim=-1).to(vt.dtype) @ vt[:, :, :e]
    return out.transpose(1, 2)


class EvalLM(torch.nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.embed = torch.nn.Embedding(c.vocab, c.d_model)
        self.blocks = torch.nn.ModuleList([Block(c) for _ in range(c.n_layers)])
        self.norm = RMSNorm(c.d_model, c.norm_eps)
        self.head = torch.nn.Linear(c.d_model, c.vocab, bias=False)
        self.apply(self._init)
        if c.tied:
            self.head.weight = self.embed.weight
        for b in self.blocks:   # residual projections scaled down with depth
            torch.nn.init.normal_(b.wo.weight, std=0.02 / math.sqrt(2 * c.n_layers))
            torch.nn.init.normal_(b.w2.weight, std=0.02 / math.sqrt(2 * c.n_layers))

    @staticmethod
    def _init(m):
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens):
        """tokens [B, n] -> logits [B, n, vocab]."""
        c = self.c
        n = tokens.shape[1]
        cos, sin = rope_cos_sin(torch.arange(n), c.head_dim, c.rope_theta, tokens.device)
        x = self.embed(tokens)
        for b in self.blocks:
            q, _, k, v = b.qkv(x, cos, sin)
            a = causal_attention(q, k, v)
            x = x + b.wo(a.flatten(-2))
            x = x + b.mlp(x)
        return self.head(self.norm(x))


def save(model: EvalLM, path, meta=None):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    sd = {k: v.detach().to("cpu", torch.bfloat16) for k, v in model.state_dict().items()
          if not (model.c.tied and k == "head.weight")}
    torch.save({"config": asdict(model.c), "state": sd, "meta": meta or {}}, path)


def load(path, device="cpu"):
    try:  # our own file of tensors, lists and numbers (weights_only: torch >= 2.6 defaults to True)
        blob = torch.load(path, map_location="cpu", weights_only=False)
    except TypeError:  # torch < 1.13
        blob = torch.load(path, map_location="cpu")
    m = EvalLM(ModelConfig(**blob["config"]))
    sd = {k: v.float() for k, v in blob["state"].items()}
    if m.c.tied:
        sd["head.weight"] = sd["embed.weight"]
    m.load_state_dict(sd)
    return m.to(device).eval(), blob.get("meta", {})


# --- Backbones -----------------------------------------------------------------------------

@dataclass
class Prefill:
    k_pre: List[torch.Tensor]    # per layer [n, h, d]
    k_post: List[torch.Tensor]   # per layer [n, h, d]
    v: List[torch.Tensor]        # per layer [n, h, d]
    q_obs: List[torch.Tensor]    # per layer [obs, hq, d]
    logits: torch.Tensor         # [vocab], the last position's


class OwnBackbone:
    """EvalLM in float32 with q, k, v rounded to bf16 (as stored by kvshade)."""

    def __init__(self, model: EvalLM, device):
        self.m, self.c, self.device = model.float().to(device).eval(), model.c, device
        self.num_layers, self.hq, self.h, self.d = self.c.n_layers, self.c.n_heads, self.c.n_kv_heads, self.c.head_dim

    def spec(self, model_id):
        import kvshade
        return kvshade.ModelSpec(model_id, num_layers=self.num_layers, num_query_heads=self.hq,
                                 num_kv_heads=self.h, head_dim=self.d, rope_theta=self.c.rope_theta)

    def _cos_sin(self, pos):
        return rope_cos_sin(pos, self.d, self.c.rope_theta, self.device)

    def encode(self, sample_tokens):
        return torch.as_tensor(sample_tokens, dtype=torch.long)

    @torch.no_grad()
    def prefill(self, ids, obs=16):
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        n = ids.shape[0]
        cos, sin = self._cos_sin(torch.arange(n))
        x = self.m.embed(ids)[None]
        out = Prefill([], [], [], [], None)
        for b in self.m.blocks:
            h = b.n1(x)
            q = bf16r(b.wq(h).unflatten(-1, (self.hq, self.d)))
            kp = bf16r(b.wk(h).unflatten(-1, (self.h, self.d)))
            v = bf16r(b.wv(h).unflatten(-1, (self.h, self.d)))
            q, k = bf16r(apply_rope(q, cos, sin)), bf16r(apply_rope(kp, cos, sin))
            a = causal_attention(q, k, v)
            x = x + b.wo(a.flatten(-2))
            x = x + b.mlp(x)
            out.k_pre.append(kp[0]); out.k_post.append(k[0]); out.v.append(v[0]); out.q_obs.append(q[0, -obs:])
        out.logits = self.m.head(self.m.norm(x[0, -1])).float()
        return out

    @torch.no_grad()
    def step(self, token, pos, attend):
        cos, sin = self._cos_sin(torch.tensor([pos]))
        x = self.m.embed(torch.tensor([int(token)], device=self.device))
        for layer, b in enumerate(self.m.blocks):
            h = b.n1(x)
            q = bf16r(apply_rope(bf16r(b.wq(h).unflatten(-1, (self.hq, self.d))), cos, sin))[0]
            k = bf16r(apply_rope(bf16r(b.wk(h).unflatten(-1, (self.h, self.d))), cos, sin))[0]
            v = bf16r(b.wv(h).unflatten(-1, (self.h, self.d)))[0]
            a = attend(layer, q, k, v).to(self.device, torch.float32)
            x = x + b.wo(a.reshape(1, -1))
            x = x + b.mlp(x)
        return self.m.head(self.m.norm(x[0])).float()


class HFBackbone:
    """A Hugging Face Llama-style causal LM (Llama, Mistral, Qwen2, Qwen3: q/k/v/o
    projections, optional q_norm/k_norm, one rotary embedding for all layers), its modules
    driven one by one so that attention can be replaced. Weights in bf16 on `device`."""

    def __init__(self, path, device):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        try:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        except TypeError:   # transformers 4.x
            self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
        self.model = self.model.to(device).eval()
        self.tok = AutoTokenizer.from_pretrained(path)
        self.device, self.path = device, path
        self.inner = self.model.model
        cfg = self.model.config
        get = getattr(cfg, "get_text_config", None)
        tc = get() if callable(get) else cfg
        self.num_layers = int(tc.num_hidden_layers)
        self.hq = int(tc.num_attention_heads)
        self.h = int(getattr(tc, "num_key_value_heads", None) or self.hq)
        self.d = int(getattr(tc, "head_dim", None) or tc.hidden_size // self.hq)

    def spec(self, model_id):
        from kvshade.integrations import hf_cache
        return hf_cache.model_spec_from_config(self.model.config, model_id,
                                               rotary=hf_cache.find_rotary_embedding(self.model))

    def encode(self, sample_tokens):
        from tasks import render_text
        ids = self.tok(render_text(sample_tokens), return_tensors="pt").input_ids[0]
        return ids

    def _rope(self, x, pos):
        pos_ids = torch.as_tensor(pos, device=self.device)[None]
        cos, sin = self.inner.rotary_emb(x.float(), pos_ids)   # [1, n, d], float32 (x gives the dtype)
        return cos[0].float(), sin[0].float()

    @staticmethod
    def _rot(x, cos, sin):
        """x [n, heads, d] float32, HF half-split rotation with the model's own cos/sin [n, d]."""
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos[:, None] + rot * sin[:, None]

    def _qkv(self, layer, x, cos, sin):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        n = h.shape[0]
        q = a.q_proj(h).view(n, self.hq, self.d)
        k = a.k_proj(h).view(n, self.h, self.d)
        v = a.v_proj(h).view(n, self.h, self.d)
        if hasattr(a, "q_norm"):
            q, k = a.q_norm(q), a.k_norm(k)
        kp = bf16r(k.float())
        return bf16r(self._rot(q.float(), cos, sin)), kp, bf16r(self._rot(kp, cos, sin)), bf16r(v.float())

    @torch.no_grad()
    def prefill(self, ids, obs=16):
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        n = ids.shape[0]
        x = self.inner.embed_tokens(ids)
        cos, sin = self._rope(x[None], torch.arange(n))
        out = Prefill([], [], [], [], None)
        for layer in self.inner.layers:
            q, kp, k, v = self._qkv(layer, x, cos, sin)
            a = causal_attention(q[None].to(torch.bfloat16), k[None].to(torch.bfloat16), v[None].to(torch.bfloat16))[0]
            x = x + layer.self_attn.o_proj(a.reshape(n, -1).to(x.dtype))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            out.k_pre.append(kp); out.k_post.append(k); out.v.append(v); out.q_obs.append(q[-obs:])
        out.logits = self.model.lm_head(self.inner.norm(x[-1:]))[0].float()
        return out

    @torch.no_grad()
    def step(self, token, pos, attend):
        x = self.inner.embed_tokens(torch.tensor([int(token)], device=self.device))
        cos, sin = self._rope(x[None], torch.tensor([pos]))
        for li, layer in enumerate(self.inner.layers):
            q, _, k, v = self._qkv(layer, x, cos, sin)
            a = attend(li, q[0], k[0], v[0]).to(self.device)
            x = x + layer.self_attn.o_proj(a.reshape(1, -1).to(x.dtype))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(self.inner.norm(x))[0].float()


def write_config(path, c: ModelConfig):
    with open(path, "w") as f:
        json.dump(asdict(c), f, indent=1)
