"""HF checkpoint directories: ``config.json`` + ``model.safetensors`` (or sharded with an index), in and out.

Reading uses the ``safetensors`` library (numpy framework); float8 tensors, which numpy cannot represent,
are read from the same file through the documented safetensors layout (8-byte little-endian header length,
JSON header with ``dtype``/``shape``/``data_offsets``) into ``ml_dtypes`` arrays. Writing uses
``safetensors.flax.save_file``. Shards follow the HF convention (``model.safetensors.index.json`` with a
``weight_map``).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

from fp8rl_jax.models.config import ModelConfig

_F8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated or inconsistent (the message names the file and tensor)."""


def _read_header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"corrupt safetensors file {path}: shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        size = os.path.getsize(path)
        if n > size - 8:
            raise CheckpointError(f"corrupt safetensors file {path}: header length {n} exceeds file size {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"corrupt safetensors file {path}: unreadable JSON header ({e})") from e
    return header, 8 + n


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Read every tensor of one ``.safetensors`` file into numpy (bf16/fp8 as ``ml_dtypes``).

    Raises:
      FileNotFoundError: ``path`` does not exist.
      CheckpointError: the file is truncated or its header is corrupt.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    header, data_start = _read_header(path)
    size = os.path.getsize(path)
    for name, meta in header.items():
        if name != "__metadata__" and data_start + meta["data_offsets"][1] > size:
            raise CheckpointError(f"corrupt safetensors file {path}: tensor {name} extends past the end "
                                  f"of the file (truncated download?)")
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    f8_names = [k for k, m in header.items() if k != "__metadata__" and m["dtype"] in _F8]
    try:
        with safe_open(path, framework="np") as f:
            for name in f.keys():
                if name not in f8_names:
                    out[name] = f.get_tensor(name)
    except Exception as e:  # safetensors raises its own SafetensorError for corrupt files
        raise CheckpointError(f"corrupt safetensors file {path}: {e}") from e
    if f8_names:
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        for name in f8_names:
            meta = header[name]
            a, b = meta["data_offsets"]
            out[name] = np.array(mm[data_start + a:data_start + b]).view(_F8[meta["dtype"]]).reshape(meta["shape"])
    return out


def load_hf_dir(path: str) -> tuple[ModelConfig, dict[str, np.ndarray], dict[str, Any]]:
    """Load an HF model directory.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` or ``model.safetensors.index.json`` + shards.

    Returns:
      ``(config, {hf_name: np.ndarray}, raw_config_dict)``.

    Raises:
      FileNotFoundError: directory, config or a weight file is missing (the path is named).
      CheckpointError: corrupt file, or a shard listed in the index lacks a tensor.
      ValueError: unknown architecture.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory not found: {path}")
    cfg_path = os.path.join(path, "config.json")
    cfg = ModelConfig.from_json_file(cfg_path)
    with open(cfg_path) as f:
        raw = json.load(f)
    index = os.path.join(path, INDEX_NAME)
    params: dict[str, np.ndarray] = {}
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        for shard in sorted(set(weight_map.values())):
            params.update(read_safetensors(os.path.join(path, shard)))
        missing = sorted(k for k in weight_map if k not in params)
        if missing:
            raise CheckpointError(f"{index} lists tensors not found in their shards: {missing[:5]}")
    else:
        single = os.path.join(path, SINGLE_NAME)
        if not os.path.isfile(single):
            raise FileNotFoundError(f"no weights in {path}: expected {SINGLE_NAME} or {INDEX_NAME}")
        params = read_safetensors(single)
    return cfg, params, raw


def save_hf_dir(path: str, cfg: ModelConfig, params: dict[str, Any], *, max_shard_bytes: int | None = None,
                extra_config: dict[str, Any] | None = None) -> None:
    """Write an HF directory (``config.json`` + safetensors, sharded when ``max_shard_bytes`` is set).

    Args:
      path: output directory (created).
      cfg: model config (``config.json`` is ``cfg.to_hf_dict()`` updated with ``extra_config``, e.g. an FP8
        ``quantization_config``).
      params: ``{hf_name: array}`` (numpy or jax; any dtype including e4m3).
      max_shard_bytes: shard size limit; writes ``model-0000i-of-0000n.safetensors`` + index when exceeded.
      extra_config: keys merged into ``config.json``.

    The safetensors files carry header metadata ``{"format": "pt"}`` (what ``safetensors.torch.save_file`` writes
    and torch-side loaders expect) and get the mode of a normally created file, ``0666 & ~umask`` (the
    ``safetensors`` writer itself leaves 0600).
    """
    from safetensors.numpy import save_file as _save_np

    umask = os.umask(0)  # read the process umask (no portable getter); restored at once
    os.umask(umask)

    def save_file(tensors: dict[str, Any], file: str) -> None:
        _save_np({k: np.asarray(v) for k, v in tensors.items()}, file, metadata={"format": "pt"})
        os.chmod(file, 0o666 & ~umask)

    os.makedirs(path, exist_ok=True)
    conf = cfg.to_hf_dict()
    conf.update(extra_config or {})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(conf, f, indent=2)
    items = sorted(params.items())
    shards: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, arr in items:
        nbytes = int(np.prod(arr.shape)) * np.dtype(arr.dtype).itemsize
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, arr))
        size += nbytes
    if len(shards) == 1:
        save_file(dict(shards[0]), os.path.join(path, SINGLE_NAME))
        return
    weight_map = {}
    n = len(shards)
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(dict(shard), os.path.join(path, fname))
        weight_map.update({k: fname for k, _ in shard})
    total = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for _, a in items)
    with open(os.path.join(path, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
