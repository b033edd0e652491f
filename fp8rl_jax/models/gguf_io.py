"""Load a llama.cpp GGUF checkpoint into HF-named float32 numpy arrays and a :class:`ModelConfig`.

Supported GGUF architectures: ``llama`` (also Mistral-shaped files, which llama.cpp writes as ``llama``),
``qwen2`` and ``qwen3`` (dense). Every tensor is dequantized to float32 with ``gguf.quants.dequantize``
(F32/F16/BF16/Q4_0/Q4_1/Q5_x/Q8_0/K-quants/...), renamed to the HF checkpoint names of
:func:`fp8rl_jax.models.config.hf_param_shapes`, and checked against that name/shape contract.

Two layout facts of the format (llama.cpp ``convert_hf_to_gguf.py`` / ``gguf-py``):

* GGUF lists tensor dimensions innermost first (``[in, out]`` for a linear); the arrays returned here are in
  numpy/HF order (``[out, in]``).
* For the Llama architecture the converter permutes the rows of ``q_proj``/``k_proj`` (weights and biases)
  from HF's "rotate half" RoPE layout into GGML's interleaved-pair layout, per head:
  ``w.reshape(n_head, 2, head_dim // 2, ...).swapaxes(1, 2)``. :func:`unpermute_rotary` undoes it. Qwen2 and
  Qwen3 files are written without that permutation (their converter does not apply it), so they are not touched.

Untrusted files (e.g. a GGUF from an unofficial uploader or assembled from parts; docs/ASSETS.md) should be checked with
:func:`verify_sha256` (or ``load_gguf(..., expected_sha256=...)``) before they are parsed.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

import numpy as np

from fp8rl_jax.models.config import ModelConfig, hf_param_shapes

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# GGUF per-layer tensor stem -> HF per-layer suffix (weights and, where they exist, biases).
_LAYER_MAP = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


# --------------------------------------------------------------------------------------------- file checks


def verify_sha256(path: str | os.PathLike, expected: str, *, chunk_bytes: int = 1 << 22) -> str:
    """Hash a file with SHA-256 and refuse it unless the digest matches ``expected``.

    Args:
      path: file to hash (read in ``chunk_bytes`` chunks; never parsed).
      expected: the full 64-hex-digit digest, or a prefix of it of at least 8 hex digits (case-insensitive).

    Returns:
      The full lowercase hex digest.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: ``expected`` is not hex / too short, or the digest does not match (the file is refused).
    """
    path = os.fspath(path)
    exp = expected.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{8,64}", exp):
        raise ValueError(f"expected sha256 must be 8..64 hex digits, got {expected!r}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"file to verify not found: {path}")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    digest = h.hexdigest()
    if not digest.startswith(exp):
        raise ValueError(f"sha256 mismatch for {path}: got {digest}, expected {exp}"
                         f"{'' if len(exp) == 64 else '...'}; refusing to load this file")
    return digest


def _open_reader(path: str | os.PathLike):
    """``gguf.GGUFReader`` with the library's assorted parse errors turned into a clear ValueError."""
    import gguf  # local: keep module import cheap

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if os.path.isdir(path):
        raise ValueError(f"expected a .gguf file, got a directory: {path}")
    size = os.path.getsize(path)
    try:
        reader = gguf.GGUFReader(path, "r")
    except (FileNotFoundError, PermissionError):
        raise
    except Exception as e:  # bad magic, truncated header/metadata/tensor data: numpy/struct/index errors
        raise ValueError(f"corrupt or truncated GGUF file {path} ({size} bytes): "
                         f"{type(e).__name__}: {e}") from e
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise ValueError(f"corrupt or truncated GGUF file {path}: tensor {t.name!r} needs bytes up to "
                             f"{int(t.data_offset) + int(t.n_bytes)} but the file has {size}")
    return reader


def _fields(reader) -> dict[str, Any]:
    """All metadata key/values of a reader as Python values (strings, ints, floats, bools, lists)."""
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception as e:  # a field the reader can describe but not decode
            raise ValueError(f"corrupt GGUF metadata field {key!r}: {type(e).__name__}: {e}") from e
    return out


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """All GGUF metadata of ``path`` as a dict of Python values (arrays as lists); tensors are not read.

    Keys are llama.cpp's (``general.architecture``, ``llama.block_count``, ``tokenizer.ggml.tokens``, ...).

    Raises:
      FileNotFoundError: missing file. ValueError: not a GGUF file, or corrupt/truncated.
    """
    return _fields(_open_reader(path))


# ------------------------------------------------------------------------------------------- RoPE layout


def read_gguf_config(path: str | os.PathLike) -> ModelConfig:
    """The :class:`ModelConfig` of a GGUF file from its metadata and tensor names only (no tensor data is read).

    Raises:
      FileNotFoundError: no such file.
      ValueError: not a GGUF file, truncated, or an unsupported architecture (as :func:`load_gguf`).
    """
    reader = _open_reader(path)
    return gguf_model_config(_fields(reader), [t.name for t in reader.tensors], str(path))


def permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> GGML row order for Llama ``q_proj``/``k_proj`` (what llama.cpp's converter writes).

    Args:
      w: ``[n_head * head_dim, ...]`` weight (``[out, in]``) or bias (``[out]``), HF "rotate half" layout.
      n_head: heads of this projection (``num_attention_heads`` for q, ``num_key_value_heads`` for k).

    Returns:
      Same shape; within each head, rows ``(half, j)`` move to ``(j, half)`` (interleaved rotary pairs).
      Source: llama.cpp ``convert_hf_to_gguf.py`` ``LlamaModel.permute``.
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_rotary`: GGML interleaved rotary rows back to HF "rotate half" order.

    Args/returns as :func:`permute_rotary` (same shape and dtype).
    """
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# -------------------------------------------------------------------------------------------------- config


def _f32(v: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (``1e-05``, not ``9.99999974e-06``),
    i.e. the value the HF config the file was converted from most likely held."""
    return float(str(np.float32(v)))


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _req(meta: dict[str, Any], key: str, path: str) -> Any:
    if key not in meta:
        raise ValueError(f"GGUF file {path} lacks required metadata key {key!r}")
    return meta[key]


def gguf_model_config(meta: dict[str, Any], tensor_names: list[str] | tuple[str, ...], path: str = "<gguf>") -> ModelConfig:
    """Build a :class:`ModelConfig` from GGUF metadata and the file's tensor names.

    Mapping (``A`` = ``general.architecture``): ``A.embedding_length`` -> hidden_size, ``A.block_count`` ->
    num_hidden_layers, ``A.feed_forward_length`` -> intermediate_size, ``A.attention.head_count(_kv)`` ->
    heads, ``A.attention.key_length`` (else ``A.rope.dimension_count`` for llama, else hidden/heads) ->
    head_dim, ``A.attention.layer_norm_rms_epsilon``, ``A.rope.freq_base``, ``A.context_length``; vocab_size
    from ``tokenizer.ggml.tokens`` (else ``A.vocab_size``); ``tie_word_embeddings`` = no ``output.weight``
    tensor; float32 values (eps, RoPE base) as their shortest decimal; bos/eos/pad from ``tokenizer.ggml.{bos,eos,padding}_token_id``; RoPE ``linear`` scaling from
    ``A.rope.scaling.*``.

    Raises:
      ValueError: unknown architecture (named), missing keys, unsupported RoPE scaling (yarn, ...).
    """
    arch = _req(meta, "general.architecture", path)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}; supported: "
                         f"{list(SUPPORTED_GGUF_ARCHITECTURES)}")
    g = lambda k, d=None: meta.get(f"{arch}.{k}", d)  # noqa: E731
    hidden = int(_req(meta, f"{arch}.embedding_length", path))
    n_head = _req(meta, f"{arch}.attention.head_count", path)
    n_kv = g("attention.head_count_kv", n_head)
    if isinstance(n_head, list) or isinstance(n_kv, list):
        raise ValueError(f"GGUF file {path} has per-layer head counts, which are not supported")
    n_head, n_kv = int(n_head), int(n_kv)
    head_dim = g("attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = g("rope.dimension_count")
    head_dim = int(head_dim) if head_dim is not None else hidden // n_head
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens else g("vocab_size")
    if vocab is None:
        raise ValueError(f"GGUF file {path} has neither tokenizer.ggml.tokens nor {arch}.vocab_size")

    rope_scaling = None
    stype = g("rope.scaling.type")
    if stype not in (None, "none"):
        if stype != "linear":
            raise ValueError(f"GGUF file {path}: RoPE scaling type {stype!r} is not supported (only linear)")
        rope_scaling = {"rope_type": "linear", "factor": _f32(_req(meta, f"{arch}.rope.scaling.factor", path))}

    eos = meta.get("tokenizer.ggml.eos_token_id")
    names = set(tensor_names)
    return ModelConfig(
        model_type=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_req(meta, f"{arch}.feed_forward_length", path)),
        num_hidden_layers=int(_req(meta, f"{arch}.block_count", path)),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=_f32(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32(g("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(g("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2" or any(n.endswith(".attn_q.bias") for n in names),
        qk_norm=arch == "qwen3",
        bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_opt_int(eos),
        pad_token_id=_opt_int(meta.get("tokenizer.ggml.padding_token_id")),
    )


# ------------------------------------------------------------------------------------------------- tensors


def gguf_to_hf_name(name: str) -> str | None:
    """HF checkpoint name of a GGUF tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), or None when the name is not a dense-decoder tensor."""
    if name in _GLOBAL_MAP:
        return _GLOBAL_MAP[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}.{m.group(3)}"
    return None


def load_gguf(path: str | os.PathLike, *, expected_sha256: str | None = None,
              check_finite: bool = True) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a GGUF checkpoint as ``(ModelConfig, {hf_name: float32 array})``.

    Arrays are dequantized to ``np.float32`` (own memory, not views of the file), in HF layout: linears
    ``[out, in]``, embeddings ``[vocab, hidden]``, norms/biases ``[n]``; Llama q/k rows are un-permuted
    (:func:`unpermute_rotary`). The names and shapes equal :func:`hf_param_shapes` of the returned config
    (no ``lm_head.weight`` when embeddings are tied).

    Args:
      path: the ``.gguf`` file.
      expected_sha256: when given, :func:`verify_sha256` runs first and the file is refused on mismatch.
      check_finite: reject tensors containing NaN/inf.

    Raises:
      FileNotFoundError: the file does not exist (path named).
      ValueError: not a GGUF / corrupt or truncated file; unknown architecture (named); a tensor that is
        unknown, missing, mis-shaped against ``hf_param_shapes`` or non-finite (tensor named); sha256 mismatch.
    """
    import gguf

    path = os.fspath(path)
    if expected_sha256 is not None:
        verify_sha256(path, expected_sha256)
    reader = _open_reader(path)
    meta = _fields(reader)
    tensor_names = [t.name for t in reader.tensors]
    cfg = gguf_model_config(meta, tensor_names, path)
    expected = hf_param_shapes(cfg)

    params: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = t.name
        if name == "rope_freqs.weight":  # llama3-style per-frequency RoPE factors
            freqs = gguf.quants.dequantize(t.data, t.tensor_type)
            if not np.all(freqs == 1.0):
                raise ValueError(f"GGUF file {path}: tensor 'rope_freqs.weight' (llama3 RoPE scaling) is not "
                                 "supported; load the HF safetensors checkpoint instead")
            continue
        hf = gguf_to_hf_name(name)
        if hf is None or hf not in expected:
            raise ValueError(f"GGUF file {path}: unexpected tensor {name!r} (HF name {hf!r}) for a "
                             f"{cfg.model_type} model with this config")
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"GGUF tensor {name!r}: quantization type {t.tensor_type.name} is not supported "
                             f"by the installed gguf package: {e}") from e
        shape = tuple(int(s) for s in reversed([int(x) for x in t.shape]))  # GGUF lists innermost first
        if arr.size != int(np.prod(shape)):
            raise ValueError(f"GGUF tensor {name!r}: {arr.size} values do not fill its declared shape {shape}")
        arr = np.array(arr, dtype=np.float32, copy=True).reshape(shape)
        if shape != tuple(expected[hf]):
            raise ValueError(f"GGUF tensor {name!r} -> {hf!r}: shape {shape} != expected {tuple(expected[hf])} "
                             f"from the config")
        if cfg.model_type == "llama" and (".attn_q." in name or ".attn_k." in name):
            n = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
            arr = np.ascontiguousarray(unpermute_rotary(arr, n))
        if check_finite and not np.isfinite(arr).all():
            bad = int(np.size(arr) - np.isfinite(arr).sum())
            raise ValueError(f"GGUF file {path}: tensor {name!r} ({hf}) has {bad} NaN/inf values")
        if hf in params:
            raise ValueError(f"GGUF file {path}: tensor {name!r} maps to {hf!r} twice")
        params[hf] = arr
    missing = sorted(set(expected) - set(params))
    if missing:
        raise ValueError(f"GGUF file {path} is missing tensors for {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''} ({len(missing)} in all)")
    return cfg, params
