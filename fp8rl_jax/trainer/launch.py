"""Settings of a Ray launch (``scripts/launch_ray.py``): the gin namespace ``ray_launch`` and how the launcher's flags
meet the gin bindings.

Gin is the one source of settings. Every flag of ``scripts/launch_ray.py`` that changes the run names a gin binding
(:data:`FLAG_BINDINGS`: ``--rollout_engine`` is ``train.rollout_engine``, ``--num_rollout_actors`` is
``ray_launch.num_rollout_actors``, ...). A flag that is not given leaves the binding (or its default) alone; a
given flag sets the binding, unless the gin files / ``--gin_param`` bind it to another value, which is an error
naming both (:func:`resolve_flag_bindings`). So ``launch_ray.py --gin_file=configs/paper/exp1_dense_w8a8.gin`` runs
the vLLM rollout actors that config's ``train.rollout_engine = "vllm"`` asks for.

``ray_launch.gpus_per_actor = None`` (the default) gives the actors the GPUs the cluster has:
:func:`auto_gpus_per_bundle` splits the nodes' GPUs evenly over the job's bundles (the trainer's and one per rollout
actor, or one per trainer process), whole GPUs where there are enough, else equal fractions of one; a CPU cluster
gives 0. Set ``ray_launch.gpus_per_actor`` (or ``--gpus_per_actor``) to choose yourself.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import gin

RAY_TRANSPORTS = ("shm", "dist")
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "STRICT_SPREAD")


@gin.configurable("ray_launch")
@dataclasses.dataclass(frozen=True)
class RayLaunchConfig:
    """How ``scripts/launch_ray.py`` lays a run out on a Ray cluster (gin ``ray_launch.*``; each has a flag).

    Attributes:
      num_rollout_actors: rollout actors (vLLM or the embedded engine, as ``train.rollout_engine`` says).
      num_trainer_processes: > 1: a multi-host trainer, one JAX process per bundle, each with its own rollout engine
        (no rollout actors).
      spread: multi-host: one trainer process per node (``STRICT_SPREAD``).
      transport: weight sync to the rollout actors: ``"shm"`` (one node; ``STRICT_PACK``) or ``"dist"``
        (``torch.distributed`` broadcast; any nodes, ``PACK``).
      cpus_per_actor: CPUs of every bundle (trainer and rollout actors alike).
      gpus_per_actor: GPUs of every bundle; None (default) = the cluster's GPUs split over the bundles
        (:func:`auto_gpus_per_bundle`); 0 = CPU only.

    Raises:
      ValueError: a count below 1, an unknown transport, negative resources (the binding named).
    """

    num_rollout_actors: int = 1
    num_trainer_processes: int = 1
    spread: bool = False
    transport: str = "shm"
    cpus_per_actor: float = 1.0
    gpus_per_actor: float | None = None

    def __post_init__(self):
        for name in ("num_rollout_actors", "num_trainer_processes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ray_launch.{name} must be an int >= 1, got {v!r}")
        if self.transport not in RAY_TRANSPORTS:
            raise ValueError(f"ray_launch.transport={self.transport!r} is not one of {list(RAY_TRANSPORTS)}")
        if not isinstance(self.spread, bool):
            raise ValueError(f"ray_launch.spread must be True or False, got {self.spread!r}")
        if isinstance(self.cpus_per_actor, bool) or not isinstance(self.cpus_per_actor, (int, float)) \
                or not self.cpus_per_actor >= 0:
            raise ValueError(f"ray_launch.cpus_per_actor must be a number >= 0, got {self.cpus_per_actor!r}")
        g = self.gpus_per_actor
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not g >= 0):
            raise ValueError(f"ray_launch.gpus_per_actor must be a number >= 0 or None (the cluster's GPUs split "
                             f"over the actors), got {g!r}")


#: flag of scripts/launch_ray.py (without ``--``) -> the gin binding it sets
FLAG_BINDINGS: dict[str, str] = {
    "rollout_engine": "train.rollout_engine",
    "num_rollout_actors": "ray_launch.num_rollout_actors",
    "num_trainer_processes": "ray_launch.num_trainer_processes",
    "spread": "ray_launch.spread",
    "transport": "ray_launch.transport",
    "cpus_per_actor": "ray_launch.cpus_per_actor",
    "gpus_per_actor": "ray_launch.gpus_per_actor",
}


def _gin_literal(value: Any) -> str:
    """``value`` as it would be written in a gin binding (strings quoted with double quotes)."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def resolve_flag_bindings(flags: Mapping[str, Any], bound: Mapping[str, Any],
                          flag_bindings: Mapping[str, str] = FLAG_BINDINGS) -> dict[str, Any]:
    """Which gin bindings the given launcher flags set (a pure function: no gin, no Ray).

    Args:
      flags: flag name (as in :data:`FLAG_BINDINGS`, without ``--``) -> its value, None when not given.
      bound: binding key (``"train.rollout_engine"``) -> the value the gin files / ``--gin_param`` bind it to;
        only explicitly bound keys (a default is not a binding).
      flag_bindings: flag name -> binding key.

    Returns:
      ``{binding key: value}`` for every given flag (None-valued flags are left out).

    Raises:
      ValueError: a given flag whose value differs from the gin binding of the same setting; one line naming the
        flag, the binding and both values. An unknown flag name.
    """
    out: dict[str, Any] = {}
    for flag, value in flags.items():
        if flag not in flag_bindings:
            raise ValueError(f"--{flag} names no gin binding (known: {sorted(flag_bindings)})")
        if value is None:
            continue
        key = flag_bindings[flag]
        if key in bound and bound[key] != value:
            raise ValueError(f"--{flag}={value} contradicts the gin binding {key} = {_gin_literal(bound[key])}: drop "
                             f"the flag to run what the config says, or change the binding "
                             f"(--gin_param='{key}={_gin_literal(value)}')")
        out[key] = value
    return out


def gin_bound_values(keys: Sequence[str]) -> dict[str, Any]:
    """The values the current gin config binds ``keys`` to (a macro reference resolved to the macro's value);
    keys without a binding are left out."""
    out: dict[str, Any] = {}
    for key in keys:
        try:
            value = gin.query_parameter(key)
        except ValueError:  # no binding (the default applies)
            continue
        out[key] = resolve_macro(value)
    return out


def resolve_macro(value: Any) -> Any:
    """``value`` itself, or for a gin macro reference (``%NAME``) the value the macro is bound to."""
    name = macro_name(value)
    if name is None:
        return value
    try:
        return resolve_macro(gin.query_parameter(f"{name}/gin.macro.value"))
    except ValueError:
        return value


def macro_name(value: Any) -> str | None:
    """The macro's name when ``value`` is a gin macro reference (``%MODEL_DIR`` -> ``"MODEL_DIR"``), else None."""
    selector = getattr(value, "selector", None)
    scoped = getattr(value, "scoped_selector", None)
    if selector == "gin.macro" and isinstance(scoped, str) and "/" in scoped:
        return scoped.rsplit("/", 1)[0]
    return None


def auto_gpus_per_bundle(node_gpus: Sequence[float], num_bundles: int, strategy: str = "PACK") -> float:
    """GPUs per bundle when the user did not choose: the cluster's GPUs split evenly over ``num_bundles`` bundles.

    The largest whole number ``g`` such that the nodes can hold ``num_bundles`` bundles of ``g`` GPUs under the
    placement ``strategy`` (``"STRICT_PACK"``: all on one node; ``"PACK"``: any nodes; ``"STRICT_SPREAD"``: one
    bundle per node); with fewer GPUs than bundles, the largest equal fraction ``1/m`` (rounded down to Ray's
    0.0001 granularity) that fits, so the bundles share GPUs. 0 on a cluster without GPUs.

    Args:
      node_gpus: GPUs of each live node (``ray.nodes()[i]["Resources"]["GPU"]``, 0 where none).
      num_bundles: bundles to place (trainer + rollout actors, or trainer processes).
      strategy: the placement group's strategy.

    Returns:
      GPUs per bundle (a float; 0.0 when no placement with GPUs exists).

    Raises:
      ValueError: ``num_bundles < 1`` or an unknown strategy.
    """
    if num_bundles < 1:
        raise ValueError(f"num_bundles must be >= 1, got {num_bundles}")
    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"unknown placement strategy {strategy!r}; expected one of {PLACEMENT_STRATEGIES}")
    nodes = sorted((float(n) for n in node_gpus if n and n > 0), reverse=True)
    if not nodes:
        return 0.0
    if strategy == "STRICT_PACK":
        nodes = nodes[:1]

    def fits(g: float) -> bool:
        per_node = [math.floor(n / g + 1e-9) for n in nodes]
        if strategy == "STRICT_SPREAD":
            per_node = [min(1, k) for k in per_node]
        return sum(per_node) >= num_bundles

    for g in range(int(nodes[0]), 0, -1):
        if fits(g):
            return float(g)
    if strategy == "STRICT_SPREAD":  # one bundle per node: a fraction shares nothing; no node set is big enough
        return 0.0
    for m in range(2, 10_001):
        g = math.floor(10_000 / m) / 10_000
        if fits(g):
            return g
    return 0.0


def launch_plan(config, launch: RayLaunchConfig) -> tuple[str, dict[str, Any]]:
    """What ``scripts/launch_ray.py`` starts for a run (a pure function of the two configs).

    Args:
      config: the run's :class:`fp8rl_jax.trainer.TrainConfig` (its ``rollout_engine`` picks the rollout actors).
      launch: the :class:`RayLaunchConfig` (gin ``ray_launch.*`` with the flags applied).

    Returns:
      ``("multihost", kwargs of rollout_bridge.ray_launch.launch_multihost)`` when
      ``launch.num_trainer_processes > 1``, else ``("actors", kwargs of rollout_bridge.ray_launch.launch)``;
      ``gpus_per_actor`` / ``gpus_per_process`` None means the cluster's GPUs split over the bundles.
    """
    if launch.num_trainer_processes > 1:
        return "multihost", dict(num_processes=launch.num_trainer_processes, cpus_per_process=launch.cpus_per_actor,
                                 gpus_per_process=launch.gpus_per_actor, spread=launch.spread)
    return "actors", dict(num_rollout_actors=launch.num_rollout_actors, rollout_engine=config.rollout_engine,
                          transport=launch.transport, cpus_per_actor=launch.cpus_per_actor,
                          gpus_per_actor=launch.gpus_per_actor)


def describe_plan(kind: str, kwargs: Mapping[str, Any]) -> str:
    """One line saying what a :func:`launch_plan` starts (printed by the launcher before it connects)."""
    gpus = kwargs.get("gpus_per_actor", kwargs.get("gpus_per_process"))
    gpu_text = "the cluster's GPUs split over the bundles" if gpus is None else f"{gpus:g} GPU(s) each"
    if kind == "multihost":
        return (f"ray launch: {kwargs['num_processes']} trainer processes, each with its own rollout engine "
                f"(train.rollout_engine), {kwargs['cpus_per_process']:g} CPU(s) and {gpu_text}")
    return (f"ray launch: trainer + {kwargs['num_rollout_actors']} {kwargs['rollout_engine']} rollout actor(s) "
            f"(train.rollout_engine), weight sync over {kwargs['transport']}, {kwargs['cpus_per_actor']:g} CPU(s) "
            f"and {gpu_text}")
