"""The device mesh: named axes ``data`` / ``fsdp`` / ``tensor`` / ``expert``, configured by gin (``mesh.shape``).

A mesh shape is a dict ``{"data": 1, "fsdp": 8, "tensor": 1, "expert": 1}`` or the string ``"fsdp=4,tensor=2"``
(axes left out have size 1). The mesh is built over explicitly chosen devices (the first ``prod(shape)`` devices
of one platform, ``jax.devices(platform)``), so a 4-device mesh in an 8-device process is well defined, with
``jax.make_mesh`` and ``AxisType.Auto`` axes: XLA's GSPMD propagates shardings from the annotated parameters and
batch through the program (maxtext's default; JAX 0.10's ``make_mesh`` default is ``Explicit``, sharding in
types, which would turn every ambiguous op into a trace-time error in a model that carries no activation
annotations). Source: JAX "Distributed arrays and automatic parallelization"; maxtext ``create_device_mesh``
(``ici_data_parallelism`` / ``ici_fsdp_parallelism`` / ``ici_tensor_parallelism`` / ``ici_expert_parallelism``).

What each axis does is decided by the rules in :mod:`fp8rl_jax.parallel.rules` (one module owns them):
``data`` replicates the parameters and splits the batch, ``fsdp`` splits the batch and shards the parameters'
``embed`` dimension (ZeRO-3 style: gathered per layer by XLA), ``tensor`` shards heads / MLP / vocab
(Megatron style), ``expert`` shards the Qwen3-MoE experts' stacked ``[E, ...]`` dimension (each device holds
``E / expert`` experts' weights, :mod:`fp8rl_jax.models.experts`) and otherwise acts as one more fsdp/batch axis
(dense parameters' ``embed`` dimension, the batch).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import gin
import jax
import numpy as np
from jax.sharding import AxisType, Mesh

#: Mesh axis names, in mesh order (outermost first: ``data`` is the slowest-varying device index).
MESH_AXES = ("data", "fsdp", "tensor", "expert")


def parse_mesh_shape(shape: str | Mapping[str, int] | None) -> dict[str, int]:
    """A mesh shape as ``{axis: size}`` over all of :data:`MESH_AXES`, in mesh order (missing axes are 1).

    Args:
      shape: ``"fsdp=4,tensor=2"`` (spaces allowed, ``x`` also accepted as separator: ``"fsdp=4 x tensor=2"``),
        a dict ``{"fsdp": 4, "tensor": 2}``, or None / ``""`` (every axis 1: one device).

    Returns:
      ``{"data": d, "fsdp": f, "tensor": t, "expert": e}`` (ints >= 1).

    Raises:
      ValueError: an unknown axis name, a repeated axis, a size that is not a positive int, or a malformed
        string (the message names the offending part and the valid axes).
    """
    out = {a: 1 for a in MESH_AXES}
    if shape is None:
        return out
    if isinstance(shape, str):
        items: list[tuple[str, Any]] = []
        text = shape.replace(" x ", ",").replace(";", ",")
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            if "=" not in part:
                raise ValueError(f"mesh shape {shape!r}: {part!r} is not 'axis=size' (axes: {', '.join(MESH_AXES)})")
            k, v = (s.strip() for s in part.split("=", 1))
            try:
                items.append((k, int(v)))
            except ValueError:
                raise ValueError(f"mesh shape {shape!r}: size {v!r} of axis {k!r} is not an int") from None
    elif isinstance(shape, Mapping):
        items = list(shape.items())
    else:
        raise ValueError(f"mesh shape must be a 'axis=size,...' string or a dict, got {type(shape).__name__}")
    seen = set()
    for k, v in items:
        if k not in MESH_AXES:
            raise ValueError(f"unknown mesh axis {k!r} in {shape!r}; axes are {', '.join(MESH_AXES)}")
        if k in seen:
            raise ValueError(f"mesh axis {k!r} given twice in {shape!r}")
        seen.add(k)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"mesh axis {k}={v!r} in {shape!r} must be a positive int")
        out[k] = int(v)
    return out


def format_mesh_shape(shape: Mapping[str, int]) -> str:
    """``{"fsdp": 4, "tensor": 2, ...}`` -> ``"fsdp=4,tensor=2"`` (axes of size 1 left out; ``"1"`` for one device)."""
    parts = [f"{a}={int(shape.get(a, 1))}" for a in MESH_AXES if int(shape.get(a, 1)) > 1]
    return ",".join(parts) if parts else "1"


@gin.configurable("mesh")
@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Gin-configurable mesh (``mesh.shape = "fsdp=8"``; ``mesh.platform = "cpu"``).

    Attributes:
      shape: see :func:`parse_mesh_shape`; None = no mesh (the single-device path, the CPU quickstart's).
      platform: the device platform the mesh is built on (``"cpu"``, ``"gpu"``, ``"tpu"``); None = JAX's default
        backend (``jax.devices()``).

    Raises:
      ValueError: an invalid ``shape`` (at construction).
    """

    shape: Any = None
    platform: str | None = None

    def __post_init__(self):
        parse_mesh_shape(self.shape)  # validate now, not at the first step

    @property
    def axis_sizes(self) -> dict[str, int]:
        """``{axis: size}`` over :data:`MESH_AXES`."""
        return parse_mesh_shape(self.shape)

    @property
    def num_devices(self) -> int:
        """Devices the mesh needs (the product of the axis sizes)."""
        return math.prod(self.axis_sizes.values())

    @property
    def enabled(self) -> bool:
        """Whether a mesh was asked for (``shape`` is not None / empty)."""
        return self.shape not in (None, "", {})

    def build(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The :class:`jax.sharding.Mesh` (see :func:`make_mesh`)."""
        return make_mesh(self.axis_sizes, devices=devices, platform=self.platform)


def make_mesh(shape: str | Mapping[str, int] | None, *, devices: Sequence[jax.Device] | None = None,
              platform: str | None = None) -> Mesh:
    """A mesh with axes :data:`MESH_AXES` (all four, size-1 axes included) over explicitly chosen devices.

    Args:
      shape: see :func:`parse_mesh_shape`.
      devices: the devices to use (at least ``prod(shape)``; the first ``prod(shape)`` are taken); default:
        ``jax.devices(platform)``.
      platform: platform for the default devices (None: JAX's default backend).

    Returns:
      ``jax.sharding.Mesh`` with ``axis_names == MESH_AXES`` and ``AxisType.Auto`` axes.

    Raises:
      ValueError: a bad shape, or fewer devices than the mesh needs (names both counts and, on CPU, the
        ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` flag that makes N CPU devices).
    """
    sizes = parse_mesh_shape(shape)
    n = math.prod(sizes.values())
    devs = list(devices) if devices is not None else list(jax.devices(platform) if platform else jax.devices())
    if len(devs) < n:
        hint = ""
        if devs and devs[0].platform == "cpu":
            hint = (f" (on CPU, start the process with XLA_FLAGS=--xla_force_host_platform_device_count={n} to get "
                    f"{n} host devices)")
        raise ValueError(f"mesh {format_mesh_shape(sizes)} needs {n} devices, only {len(devs)} available{hint}")
    devs = devs[:n]
    return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devs)


def mesh_from(value: Any) -> Mesh | None:
    """A :class:`Mesh` from a Mesh, a :class:`MeshConfig`, a shape string/dict, or None (-> None: no mesh).

    Raises:
      ValueError: a bad shape or too few devices (:func:`make_mesh`); a value of another type.
    """
    if value is None:
        return None
    if isinstance(value, Mesh):
        return value
    if isinstance(value, MeshConfig):
        return value.build() if value.enabled else None
    if isinstance(value, (str, Mapping)):
        return make_mesh(value) if value not in ("", {}) else None
    raise ValueError(f"expected a Mesh, MeshConfig, 'axis=size,...' string, dict or None, got {type(value).__name__}")


def mesh_shape_of(mesh: Mesh) -> dict[str, int]:
    """``{axis: size}`` of a mesh (its ``mesh.shape`` as a plain dict)."""
    return {str(k): int(v) for k, v in mesh.shape.items()}
