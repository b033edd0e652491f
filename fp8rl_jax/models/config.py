"""Decoder configuration, read from an HF ``config.json`` dict (transformers 4.x and 5.x forms).

Covers the Llama, Qwen2 and Qwen3 dense families (``model_type`` in ``llama``, ``qwen2``, ``qwen3``) and
Qwen3-MoE (``qwen3_moe``: top-k routed experts, see :mod:`fp8rl_jax.models.moe`); ``mistral`` is accepted as
Llama-shaped. Field names follow HF so that a config round-trips.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe")
_ALIASES = {"mistral": "llama"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a dense decoder-only transformer (HF names).

    Attributes:
      model_type: ``"llama"`` | ``"qwen2"`` (q/k/v bias) | ``"qwen3"`` (per-head RMSNorm on q and k).
      vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
      num_key_value_heads, head_dim: sizes; ``head_dim`` defaults to ``hidden_size // num_attention_heads``.
      rms_norm_eps: RMSNorm epsilon.
      rope_theta: RoPE base; ``rope_scaling``: HF ``rope_parameters``/``rope_scaling`` dict or None
        (types "default", "linear", "llama3" are supported).
      tie_word_embeddings: lm_head shares ``model.embed_tokens.weight``.
      attention_bias: q/k/v projections have biases (Qwen2 always; Llama when ``attention_bias``).
      qk_norm: Qwen3 ``q_norm``/``k_norm``.
      bos_token_id, eos_token_id, pad_token_id: special tokens; ``eos_token_id`` may be a tuple.
      num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob, decoder_sparse_step,
        mlp_only_layers: Qwen3-MoE (HF ``Qwen3MoeConfig`` names; ``num_experts`` is also read from
        ``num_local_experts``). Layer ``i`` is sparse iff ``num_experts > 0``, ``i not in mlp_only_layers`` and
        ``(i + 1) % decoder_sparse_step == 0`` (HF ``Qwen3MoeDecoderLayer``); dense layers use
        ``intermediate_size``. ``num_experts = 0`` for dense models.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unknown architecture model_type={self.model_type!r}; supported: "
                             f"{list(SUPPORTED_ARCHITECTURES)} (and aliases {sorted(_ALIASES)})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"config field {name} must be a positive int, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.model_type == "qwen3_moe":
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
                v = getattr(self, name)
                if not isinstance(v, int) or v <= 0:
                    raise ValueError(f"qwen3_moe config field {name} must be a positive int, got {v!r}")
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds "
                                 f"num_experts={self.num_experts}")
        elif self.num_experts:
            raise ValueError(f"num_experts={self.num_experts} is only supported for model_type='qwen3_moe', "
                             f"got model_type={self.model_type!r}")

    def is_sparse_layer(self, i: int) -> bool:
        """Whether decoder layer ``i`` has a routed-experts MLP (HF ``Qwen3MoeDecoderLayer`` rule)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All end-of-sequence ids as a tuple (possibly empty)."""
        if self.eos_token_id is None:
            return ()
        return tuple(self.eos_token_id) if isinstance(self.eos_token_id, (tuple, list)) else (int(self.eos_token_id),)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from an HF ``config.json`` dict.

        Reads ``rope_theta`` either at top level (transformers 4.x) or under ``rope_parameters``
        (transformers 5.x). Raises ``ValueError`` for an unknown ``model_type`` or missing size fields.
        """
        mt = d.get("model_type")
        mt = _ALIASES.get(mt, mt)
        if mt not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unknown architecture model_type={d.get('model_type')!r} "
                             f"(architectures={d.get('architectures')}); supported: {list(SUPPORTED_ARCHITECTURES)}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"config.json is missing required fields {missing}")
        rope_params = d.get("rope_parameters") or d.get("rope_scaling") or None
        rope_theta = d.get("rope_theta")
        if rope_theta is None and isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta")
        rope_scaling = None
        if isinstance(rope_params, dict):
            rtype = rope_params.get("rope_type", rope_params.get("type", "default"))
            if rtype not in (None, "default"):
                rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        nh = int(d["num_attention_heads"])
        eos = d.get("eos_token_id")
        return cls(
            model_type=mt,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=nh,
            num_key_value_heads=int(d.get("num_key_value_heads") or nh),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // nh),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=mt == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=d.get("pad_token_id"),
            **_moe_fields(mt, d),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """HF ``config.json`` dict (transformers-loadable) for this config."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}[self.model_type]
        d = {
            "architectures": [arch], "model_type": self.model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id, "torch_dtype": "bfloat16",
        }
        if self.model_type == "llama":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        if self.model_type == "qwen3_moe":
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                     decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                     attention_bias=self.attention_bias)
        if self.rope_scaling:
            d["rope_scaling"] = dict(self.rope_scaling)
        return d

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read ``config.json``; raises ``FileNotFoundError`` / ``ValueError`` with the path named."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"model config not found: {path}")
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"corrupt config.json at {path}: {e}") from e
        return cls.from_hf_dict(d)


def _moe_fields(model_type: str, d: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE fields of an HF config dict (``num_experts`` or its alias ``num_local_experts``); {} if dense."""
    if model_type != "qwen3_moe":
        return {}
    n = d.get("num_experts", d.get("num_local_experts"))
    missing = [k for k, v in (("num_experts", n), ("num_experts_per_tok", d.get("num_experts_per_tok")),
                              ("moe_intermediate_size", d.get("moe_intermediate_size"))) if v is None]
    if missing:
        raise ValueError(f"qwen3_moe config.json is missing required fields {missing}")
    return dict(num_experts=int(n), num_experts_per_tok=int(d["num_experts_per_tok"]),
                moe_intermediate_size=int(d["moe_intermediate_size"]),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
                mlp_only_layers=tuple(int(i) for i in (d.get("mlp_only_layers") or ())))


def hf_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF checkpoint parameter names and shapes (``[out, in]`` for linears) this config implies.

    This is the name contract shared by the Flax model, the safetensors/GGUF loaders and the FP8 export.
    """
    h, d = cfg.hidden_size, cfg.head_dim
    qd, kvd = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (qd, h), p + "self_attn.k_proj.weight": (kvd, h),
            p + "self_attn.v_proj.weight": (kvd, h), p + "self_attn.o_proj.weight": (h, qd),
        })
        if cfg.is_sparse_layer(i):
            m = cfg.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (cfg.num_experts, h)
            for j in range(cfg.num_experts):
                e = f"{p}mlp.experts.{j}."
                shapes.update({e + "gate_proj.weight": (m, h), e + "up_proj.weight": (m, h),
                               e + "down_proj.weight": (h, m)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
                           p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
                           p + "mlp.down_proj.weight": (h, cfg.intermediate_size)})
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (qd,), p + "self_attn.k_proj.bias": (kvd,),
                           p + "self_attn.v_proj.bias": (kvd,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return shapes
