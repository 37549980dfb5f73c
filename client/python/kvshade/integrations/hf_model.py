"""What kvshade needs to know of a transformers model: its ModelSpec (shape and RoPE) from the
model's config, the RoPE table that spec stands for, and the check of that table against
the model's own rotary embedding (so that a RoPE kvshade would apply differently is refused
before any session is created). Used by kvshade.integrations.hf_cache (which re-exports
model_spec_from_config, find_rotary_embedding, rope_table and rope_mismatch) and
kvshade.integrations.hf_batching; needs torch and numpy, not transformers itself.
"""
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..client import ModelSpec

_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class HfModelSpec(ModelSpec):
    """ModelSpec plus the yarn betas (kvshade_model.rope_beta_fast/slow of the C ABI)."""
    rope_beta_fast: float = 0.0
    rope_beta_slow: float = 0.0

    def _c(self):
        m = super()._c()
        m.rope_beta_fast, m.rope_beta_slow = self.rope_beta_fast, self.rope_beta_slow
        return m


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _rope_params(config):
    """rope_type and its parameters, from `rope_parameters` (transformers 5) or
    `rope_theta` + `rope_scaling` (4.x); the later source wins."""
    params = {}
    theta = getattr(config, "rope_theta", None)
    if theta is not None:
        params["rope_theta"] = theta
    for name in ("rope_scaling", "rope_parameters"):
        p = getattr(config, name, None)
        if p is None:
            continue
        if not isinstance(p, dict):
            p = dict(p) if hasattr(p, "keys") else vars(p)
        if p and all(isinstance(v, dict) for v in p.values()):
            # Per layer type (e.g. {"full_attention": {...}, "sliding_attention": {...}}).
            if len(p) != 1:
                raise ValueError("config.%s has per-layer-type RoPE (%s); kvshade serves models whose "
                                 "layers share one RoPE" % (name, sorted(p)))
            p = next(iter(p.values()))
        params.update({k: v for k, v in p.items() if v is not None})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    return rope_type, params


def model_spec_from_config(config, model_id, rotary=None):
    """The kvshade ModelSpec (bf16 wire dtype) of a Llama-style config; refuses what kvshade
    cannot reproduce. With `rotary` (the model's rotary embedding module) the derived RoPE is
    checked numerically against it."""
    c = _text_config(config)
    hq = int(c.num_attention_heads)
    h = int(getattr(c, "num_key_value_heads", None) or hq)
    d = int(getattr(c, "head_dim", None) or c.hidden_size // hq)
    layers = int(c.num_hidden_layers)
    layer_types = getattr(c, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError("config.layer_types has %s; kvshade serves full-attention layers only"
                         % sorted(set(t for t in layer_types if t != "full_attention")))
    if getattr(c, "sliding_window", None) is not None and getattr(c, "use_sliding_window", True):
        raise ValueError("config.sliding_window is %r; kvshade serves full-attention layers only"
                         % c.sliding_window)
    rope_type, p = _rope_params(c)
    if rope_type not in _ROPE_TYPES:
        raise ValueError("RoPE type %r is not supported by kvshade (expected one of %s)" % (rope_type, _ROPE_TYPES))
    theta = float(p.get("rope_theta") or 10000.0)
    partial = float(p.get("partial_rotary_factor") or getattr(c, "partial_rotary_factor", None) or 1.0)
    rotary_dim = int(d * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= d:
        raise ValueError("partial_rotary_factor %g gives rotary dim %d for head_dim %d; expected an even "
                         "value in (0, %d]" % (partial, rotary_dim, d, d))
    base = dict(model_id=model_id, num_layers=layers, num_query_heads=hq, num_kv_heads=h, head_dim=d,
                rope_theta=theta, rotary_dim=0 if rotary_dim == d else rotary_dim, dtype="bf16")
    candidates = []
    if rope_type == "default":
        candidates.append(HfModelSpec(**base))
    elif rope_type == "linear":
        candidates.append(HfModelSpec(**base, rope_scaling="linear", rope_factor=float(p["factor"])))
    elif rope_type == "llama3":
        candidates.append(HfModelSpec(**base, rope_scaling="llama3", rope_factor=float(p["factor"]),
                                      rope_low_freq_factor=float(p["low_freq_factor"]),
                                      rope_high_freq_factor=float(p["high_freq_factor"]),
                                      rope_original_max_position=int(p["original_max_position_embeddings"])))
    else:  # yarn
        for name in ("mscale", "mscale_all_dim"):
            if p.get(name):
                raise ValueError("yarn with %s=%r (DeepSeek-style attention scaling) is not supported by kvshade"
                                 % (name, p[name]))
        if p.get("truncate", True) is False:
            raise ValueError("yarn with truncate=False is not supported by kvshade (it truncates the "
                             "correction range as transformers does by default)")
        factor = float(p["factor"])
        orig = int(p.get("original_max_position_embeddings") or c.max_position_embeddings)
        mscale = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
        af = p.get("attention_factor")
        if af is not None and abs(float(af) - mscale) > 1e-6 * mscale:
            raise ValueError("yarn attention_factor %r differs from 0.1*ln(factor)+1 = %r, the only attention "
                             "scaling kvshade applies" % (af, mscale))
        yarn = dict(rope_scaling="yarn", rope_original_max_position=orig,
                    rope_beta_fast=float(p.get("beta_fast") or 32.0), rope_beta_slow=float(p.get("beta_slow") or 1.0))
        candidates.append(HfModelSpec(**base, rope_factor=factor, **yarn))
        # Some transformers versions take the yarn factor as max_position / original when the
        # original is given; the numeric check below picks whichever the model really uses.
        alt = float(c.max_position_embeddings) / orig
        if p.get("original_max_position_embeddings") and alt > 1 and abs(alt - factor) > 1e-9:
            candidates.append(HfModelSpec(**base, rope_factor=alt, **yarn))
    if rotary is None:
        return candidates[0]
    errors = []
    for spec in candidates:
        err = rope_mismatch(spec, rotary)
        if err is None:
            return spec
        errors.append(err)
    raise ValueError("the model's rotary embedding (rope_type %r) does not match what kvshade would apply: %s"
                     % (rope_type, "; ".join(errors)))


def rope_table(spec, head_dim):
    """kvshade's RoPE for `spec` (kernels/common/rope.cc): per pair i the angle per position,
    float64 [rotary_dim/2], and the cos/sin magnitude."""
    rd = spec.rotary_dim or head_dim
    f32 = lambda x: float(np.float32(x))  # the C ABI carries these as float
    theta = f32(spec.rope_theta or 10000.0)
    i = np.arange(rd // 2, dtype=np.float64)
    inv = 1.0 / theta ** (2.0 * i / rd)
    factor = f32(spec.rope_factor or 1.0)
    pos_scale, magnitude = 1.0, 1.0
    if spec.rope_scaling == "linear":
        pos_scale = float(np.float32(1.0 / factor))
    elif spec.rope_scaling == "llama3":
        low, high = f32(spec.rope_low_freq_factor or 1.0), f32(spec.rope_high_freq_factor or 4.0)
        old = float(spec.rope_original_max_position or 8192)
        wavelen = 2.0 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        mid = (1.0 - smooth) * inv / factor + smooth * inv
        inv = np.where(wavelen < old / high, inv, np.where(wavelen > old / low, inv / factor, mid))
    elif spec.rope_scaling == "yarn":
        orig = float(spec.rope_original_max_position or 8192)
        bf = f32(getattr(spec, "rope_beta_fast", 0.0) or 32.0)
        bs = f32(getattr(spec, "rope_beta_slow", 0.0) or 1.0)
        corr = lambda rot: rd * math.log(orig / (rot * 2.0 * math.pi)) / (2.0 * math.log(theta))
        lo = max(math.floor(corr(bf)), 0.0)
        hi = min(math.ceil(corr(bs)), float(rd - 1))
        if lo == hi:
            hi += 0.001
        ramp = np.clip((i - lo) / (hi - lo), 0.0, 1.0)
        inv = inv / factor * ramp + inv * (1.0 - ramp)
        magnitude = 1.0 if factor <= 1 else float(np.float32(0.1 * math.log(factor) + 1.0))
    inv = inv.astype(np.float32).astype(np.float64)
    return inv * pos_scale, magnitude


def rope_mismatch(spec, rotary):
    """None when the model's rotary embedding equals kvshade's RoPE for `spec`, else why not.
    Compares inv_freq and attention_scaling where the module has them, and cos/sin at a few
    positions through its forward (x, position_ids) -> (cos, sin)."""
    d = spec.head_dim
    inv, mag = rope_table(spec, d)
    hf_inv = getattr(rotary, "inv_freq", None)
    if isinstance(hf_inv, torch.Tensor):
        a = hf_inv.detach().double().cpu().numpy().reshape(-1)
        if a.shape != inv.shape:
            return "inv_freq has %d pairs, kvshade %d" % (a.size, inv.size)
        rel = float(np.max(np.abs(a - inv) / np.maximum(np.abs(inv), 1e-30)))
        if rel > 1e-5:
            hint = ""
            if hf_inv.dtype not in (torch.float32, torch.float64):
                # model.to(torch.bfloat16) casts this buffer too, and the model then rotates
                # with rounded frequencies that kvshade does not reproduce.
                hint = (" (the model's inv_freq buffer is %s: load the model with torch_dtype=/dtype= instead of "
                        "casting it with .to(), which rounds the rotary frequencies)" % hf_inv.dtype)
            return "inv_freq differs by %.3g relative%s" % (rel, hint)
    hf_mag = getattr(rotary, "attention_scaling", None)
    if hf_mag is not None and abs(float(hf_mag) - mag) > 1e-5 * mag:
        return "attention scaling %r, kvshade %r" % (float(hf_mag), mag)
    # positions <= 512 keep fp32 angle error (transformers computes angles in fp32) < 1e-4.
    pos = torch.tensor([[0, 1, 2, 7, 31, 100, 257, 512]])
    dev = hf_inv.device if isinstance(hf_inv, torch.Tensor) else torch.device("cpu")
    try:
        with torch.no_grad():
            cos, sin = rotary(torch.zeros(1, 1, d, device=dev), pos.to(dev))
    except Exception as e:  # an unusual forward signature: the buffers above were the check
        if hf_inv is None:
            return "rotary embedding has neither inv_freq nor a (x, position_ids) forward: %s" % e
        return None
    cos = cos.detach().double().cpu().reshape(pos.shape[1], -1).numpy()
    sin = sin.detach().double().cpu().reshape(pos.shape[1], -1).numpy()
    half = inv.size
    if cos.shape[1] != 2 * half:
        return "cos has %d columns, expected rotary dim %d" % (cos.shape[1], 2 * half)
    if not (np.array_equal(cos[:, :half], cos[:, half:]) and np.array_equal(sin[:, :half], sin[:, half:])):
        return "cos/sin are not in the half-split layout [freqs, freqs]"
    ang = pos.numpy().reshape(-1, 1).astype(np.float64) * inv[None]
    err = max(float(np.abs(cos[:, :half] - mag * np.cos(ang)).max()),
              float(np.abs(sin[:, :half] - mag * np.sin(ang)).max()))
    if err > 2e-4:
        return "cos/sin differ by %.3g at positions <= 512" % err
    return None


def find_rotary_embedding(model):
    """The model's rotary embedding module (LlamaModel.rotary_emb in Llama-style models)."""
    for owner in (getattr(model, "model", None), model):
        r = getattr(owner, "rotary_emb", None)
        if isinstance(r, torch.nn.Module):
            return r
    for m in model.modules():
        if type(m).__name__.endswith("RotaryEmbedding"):
            return m
    raise ValueError("%s has no rotary embedding module (model.model.rotary_emb); kvshade.integrations.hf_cache serves "
                     "RoPE models" % type(model).__name__)
