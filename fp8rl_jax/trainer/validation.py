"""Checks that run before any work: field types of the gin-configurable dataclasses, and the run directory.

A user's wrong binding (``train.learning_rate="1e-5"``, ``LossConfig.clip_ratio_high="x"``) must fail in one line
naming the binding before a model is loaded; a second run into the same ``--output_dir`` must not overwrite the
first one's metrics and checkpoints (``--resume`` / ``--overwrite`` say what to do).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import types
import typing
from typing import Any

RUN_ARTIFACTS = ("metrics.jsonl", "summary.json", "config.gin", "checkpoints", "tensorboard", "plots")


class RunDirError(ValueError):
    """The run directory conflicts with what was asked (an earlier run without ``--resume``/``--overwrite``, or
    ``--resume`` with nothing to resume)."""


def _matches(value: Any, hint: Any) -> bool:
    """Does ``value`` fit the annotation ``hint`` (int, float (ints accepted), str, bool, unions, None, tuples)?"""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (tuple, list):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return isinstance(value, (tuple, list)) and all(_matches(v, args[0]) for v in value) if args else \
            isinstance(value, (tuple, list))
    if typing.get_origin(hint) is typing.Literal:
        return value in typing.get_args(hint)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def check_field_types(obj: Any, prefix: str) -> None:
    """Check every field of a dataclass instance against its annotation, recursing into dataclass fields.

    Args:
      obj: a dataclass instance (e.g. ``TrainConfig``, ``LossConfig``).
      prefix: the gin name of its configurable (``"train"``, ``"LossConfig"``), used in the message.

    Raises:
      TypeError: one line naming the binding, the value and the expected type, e.g.
        ``train.learning_rate='1e-5' is a str; expected float``.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), hints.get(f.name, Any)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_field_types(value, f"{type(value).__name__}")
            continue
        if not _matches(value, hint):
            raise TypeError(f"{prefix}.{f.name}={value!r} is a {type(value).__name__}; expected {_type_name(hint)}")


def checkpoint_steps(output_dir: str) -> list[int]:
    """Committed orbax checkpoint steps under ``output_dir/checkpoints``, ascending (in-flight temporaries, whose
    names are not plain integers, are left out)."""
    d = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(d):
        return []
    return sorted(int(n) for n in os.listdir(d) if n.isdigit())


def describe_run(output_dir: str) -> str | None:
    """A short description of an earlier run in ``output_dir`` (None when it holds no metrics or checkpoints)."""
    steps = checkpoint_steps(output_dir)
    metrics = os.path.join(output_dir, "metrics.jsonl")
    lines = 0
    if os.path.isfile(metrics):
        with open(metrics) as f:
            lines = sum(1 for line in f if line.strip() and "reward/mean" in json.loads(line))
    if not steps and not lines:
        return None
    parts = [f"metrics of {lines} step(s)"] if lines else []
    if steps:
        parts.append(f"checkpoints at step(s) {steps}")
    return ", ".join(parts)


def prepare_run_dir(output_dir: str, resume: bool | str, overwrite: bool) -> int | None:
    """Decide, before any work, what a run does with ``output_dir``; clear it only when ``overwrite`` says so.

    Args:
      output_dir: the run directory.
      resume: ``True`` (``--resume``: continue; there must be a checkpoint), ``"auto"`` (continue when there is
        one, else start fresh), ``False`` (a new run: the directory must hold no earlier run).
      overwrite: replace an earlier run (its metrics, checkpoints, TensorBoard events, plots are deleted).

    Returns:
      the latest checkpoint step to resume from, or None.

    Raises:
      RunDirError: ``resume=True`` with no checkpoint; an earlier run without ``resume`` or ``overwrite``;
        ``resume`` and ``overwrite`` together.
    """
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other: pick one")
    steps = checkpoint_steps(output_dir)
    if resume is True and not steps:
        what = describe_run(output_dir)
        raise RunDirError(f"--resume: no checkpoint in {os.path.join(output_dir, 'checkpoints')}"
                          f"{f' (it holds {what})' if what else ''}; start a new run without --resume, or use "
                          "--resume=auto to continue only when a checkpoint exists")
    if resume and steps:
        return steps[-1]
    what = describe_run(output_dir)  # a new run (resume=False, or "auto" without a checkpoint) from here on
    if what and not overwrite:
        if resume:  # "auto", metrics but no checkpoint: starting fresh would overwrite them
            raise RunDirError(f"--resume=auto: {output_dir} holds a run ({what}) but no checkpoint to continue from; "
                              "replace it with --overwrite or pick another --output_dir")
        raise RunDirError(f"{output_dir} already holds a run ({what}): continue it with --resume, or replace it "
                          "with --overwrite")
    if overwrite:
        for name in RUN_ARTIFACTS:
            path = os.path.join(output_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
    return None
