"""A float64 numpy forward of a Llama/Qwen3 decoder from HF-named tensors (FP8 weights dequantized here).

Independent of ``fp8rl_jax.models``: written from the HF ``LlamaModel`` / ``Qwen3Model`` definitions (RMSNorm,
rotate-half RoPE, GQA causal attention with ``1/sqrt(head_dim)``, Qwen3's per-head q/k RMSNorm before RoPE, SwiGLU
MLP, tied or untied LM head). FP8 linears (``weight`` e4m3 + ``weight_scale_inv``) are dequantized blockwise in
float64 (``q * scale_inv``, the exact product); activations are not quantized, so an FP8 engine differs from this
reference by its W8A8 activation quantization and its bf16 compute, a correct one by little, a wrong scale by a lot.
"""

from __future__ import annotations

import numpy as np


def dequantize(tensors: dict, name: str, block: int = 128) -> np.ndarray:
    """``name`` as float64: ``q * scale_inv`` blockwise when ``name + "_scale_inv"`` exists, else a cast."""
    w = np.asarray(tensors[name]).astype(np.float64)
    s = tensors.get(name + "_scale_inv")
    if s is None:
        return w
    n, k = w.shape
    s = np.repeat(np.repeat(np.asarray(s, np.float64), block, axis=0), block, axis=1)[:n, :k]
    return w * s


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    f = pos[:, None] * inv[None]  # [S, D/2]
    cos, sin = np.cos(np.concatenate([f, f], -1))[:, None], np.sin(np.concatenate([f, f], -1))[:, None]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * cos + rot * sin


def logprobs64(cfg, tensors: dict, prompt, cont) -> np.ndarray:
    """float64 logprobs (temperature 1) of ``cont`` after ``prompt`` (one sequence, no padding).

    Args:
      cfg: a :class:`fp8rl_jax.models.config.ModelConfig` (only its numbers are read: sizes, eps, rope_theta,
        qk_norm, tie_word_embeddings).
      tensors: HF name -> numpy/jax array (e.g. ``ExportedWeights.tensors``).
      prompt, cont: token id lists.

    Returns:
      float64 ``[len(cont)]``.
    """
    t = {k: v for k, v in tensors.items()}
    ids = np.asarray(list(prompt) + list(cont))
    s = len(ids)
    h, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    emb = dequantize(t, "model.embed_tokens.weight")
    x = emb[ids]
    pos = np.arange(s, dtype=np.float64)
    causal = np.tril(np.ones((s, s), bool))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        y = _rms(x, dequantize(t, p + "input_layernorm.weight"), eps)
        q = (y @ dequantize(t, p + "self_attn.q_proj.weight").T).reshape(s, nh, d)
        k = (y @ dequantize(t, p + "self_attn.k_proj.weight").T).reshape(s, nkv, d)
        v = (y @ dequantize(t, p + "self_attn.v_proj.weight").T).reshape(s, nkv, d)
        if cfg.qk_norm:
            q = _rms(q, dequantize(t, p + "self_attn.q_norm.weight"), eps)
            k = _rms(k, dequantize(t, p + "self_attn.k_norm.weight"), eps)
        q, k = _rope(q, pos, cfg.rope_theta), _rope(k, pos, cfg.rope_theta)
        g = nh // nkv
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
        sc = np.einsum("shd,thd->hst", q, k) / np.sqrt(d)
        sc = np.where(causal[None], sc, -np.inf)
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        att = np.einsum("hst,thd->shd", pr, v).reshape(s, nh * d)
        x = x + att @ dequantize(t, p + "self_attn.o_proj.weight").T
        y = _rms(x, dequantize(t, p + "post_attention_layernorm.weight"), eps)
        gate = y @ dequantize(t, p + "mlp.gate_proj.weight").T
        up = y @ dequantize(t, p + "mlp.up_proj.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ dequantize(t, p + "mlp.down_proj.weight").T
    x = _rms(x, dequantize(t, "model.norm.weight"), eps)
    head = emb if cfg.tie_word_embeddings else dequantize(t, "lm_head.weight")
    logits = x[len(prompt) - 1:-1] @ head.T
    m = logits.max(-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(logits - m).sum(-1))
    return logits[np.arange(len(cont)), np.asarray(cont)] - lse
