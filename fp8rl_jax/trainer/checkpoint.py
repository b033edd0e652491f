"""Orbax checkpoints of an RL run: params, optimizer state, step, data position, loss scale, extra state.

A thin layer over ``orbax.checkpoint.CheckpointManager`` (keep-last-k = ``max_to_keep``, every N steps =
``save_interval_steps``, async writes = ``enable_async_checkpointing``). One checkpoint ``<dir>/<step>/`` holds
the items

* ``params``: the model's float32 master params as a nested pure dict (``nnx.to_pure_dict`` of
  ``nnx.state(model, nnx.Param)``), HF-named paths;
* ``optimizer``: the whole ``nnx.Optimizer`` state: optax state (AdamW moments, clip/apply-if-finite
  counters), the optimizer ``step`` and, for fp16, the dynamic loss-scale state;
* ``extra``: arrays other parts of the trainer register (e.g. KV-cache ``k_scale``/``v_scale``), omitted when
  there are none;
* ``meta``: JSON: the RL step, the data iterator's ``state_dict()``, the seed, the precision.

Crash safety follows orbax's atomic save: every item is written into ``<dir>/<step>.orbax-checkpoint-tmp-*``
and the directory is renamed to ``<dir>/<step>`` only after all writes have finished, so a ``kill -9``
mid-save leaves at worst a tmp directory that :meth:`CheckpointStore.latest_step` never reports (and that
``cleanup_tmp_directories`` removes on the next start).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

FORMAT_VERSION = 1
ITEMS = ("params", "optimizer", "extra")


class CheckpointNotFoundError(FileNotFoundError):
    """No (such) checkpoint in a checkpoint directory; the message names the directory and the steps there."""


def _ocp():
    import orbax.checkpoint as ocp

    return ocp


def _abstract(tree: Any) -> Any:
    """Shape/dtype(/sharding) skeleton of a pytree of arrays (the restore target).

    A ``jax.Array`` leaf keeps its sharding, so orbax restores each array straight into that sharding (each device
    reads only its own slices), whatever mesh the checkpoint was saved from: a checkpoint written on 8 devices
    restores onto a 4-device mesh (orbax "restoring with a different sharding"; tests/test_mesh.py). Host (numpy)
    leaves come back as saved.
    """
    def one(x):
        dtype = getattr(x, "dtype", None) or np.asarray(x).dtype
        sharding = x.sharding if isinstance(x, jax.Array) else None
        return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding)

    return jax.tree.map(one, tree)


class CheckpointStore:
    """Save and restore RL checkpoints in one directory with orbax.

    Args:
      directory: the checkpoint root (created on first save; e.g. ``<output_dir>/checkpoints``).
      max_to_keep: keep the newest k checkpoints (older ones are deleted after a newer one is committed).
      save_interval_steps: :meth:`save` writes only at steps divisible by it (unless ``force``).
      async_save: write in a background thread (orbax async checkpointing): :meth:`save` returns once the
        arrays are copied to host memory; :meth:`wait` blocks until the write is committed.

    Raises:
      ValueError: ``max_to_keep < 1`` or ``save_interval_steps < 1``.
    """

    def __init__(self, directory: str, *, max_to_keep: int = 2, save_interval_steps: int = 1,
                 async_save: bool = True):
        if max_to_keep < 1 or save_interval_steps < 1:
            raise ValueError(f"max_to_keep and save_interval_steps must be >= 1, got {max_to_keep}, "
                             f"{save_interval_steps}")
        ocp = _ocp()
        self.directory = os.path.abspath(directory)
        self.save_interval_steps = int(save_interval_steps)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, save_interval_steps=save_interval_steps,
                                                 enable_async_checkpointing=async_save,
                                                 cleanup_tmp_directories=True, create=True))

    def __repr__(self) -> str:
        return f"CheckpointStore({self.directory!r}, steps {self.all_steps()}, every {self.save_interval_steps} steps)"

    # -- queries --------------------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Committed checkpoint steps, ascending (tmp directories of interrupted saves are not listed)."""
        self._manager.reload()
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` when the directory holds no checkpoint."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # -- save -------------------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], *, force: bool = False) -> bool:
        """Save ``state`` (``{"params": pytree, "optimizer": pytree, "extra": pytree}``) and JSON ``meta``.

        Args:
          step: the RL step the state is after (the checkpoint's name).
          state: pytrees of arrays (jax or numpy); ``"extra"`` may be empty or absent.
          meta: JSON-serializable dict; ``format_version`` and ``step`` are added.
          force: save even when ``step`` is not a multiple of ``save_interval_steps``.

        Returns:
          True if a save was started.

        Raises:
          ValueError: ``state`` lacks ``params``/``optimizer`` or has an unknown item.
        """
        ocp = _ocp()
        unknown = set(state) - set(ITEMS)
        if unknown or "params" not in state or "optimizer" not in state:
            raise ValueError(f"checkpoint state needs items 'params' and 'optimizer' (optionally 'extra'), "
                             f"got {sorted(state)}")
        items = {k: ocp.args.StandardSave(v) for k, v in state.items() if k in ITEMS and jax.tree.leaves(v)}
        meta = dict(meta, format_version=FORMAT_VERSION, step=int(step))
        items["meta"] = ocp.args.JsonSave(meta)
        return bool(self._manager.save(int(step), args=ocp.args.Composite(**items), force=force))

    def wait(self) -> None:
        """Block until every started save is committed (renamed from its tmp directory)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves and release orbax's threads."""
        self._manager.wait_until_finished()
        self._manager.close()

    # -- restore ----------------------------------------------------------------------------------------------
    def restore(self, step: int | None = None, targets: dict[str, Any] | None = None,
                items: tuple[str, ...] = ITEMS) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load a checkpoint.

        Args:
          step: which step (default: the latest committed one).
          targets: per item, a pytree with the expected structure, shapes and dtypes (arrays or
            ``ShapeDtypeStruct``); restored arrays then have exactly that structure and dtype. Items without a
            target come back as saved (numpy arrays in nested dicts).
          items: which items to read (e.g. ``("params",)`` for a weight export); ``meta`` is always read.

        Returns:
          ``(state, meta)``: ``state`` maps each saved item name to its pytree.

        Raises:
          CheckpointNotFoundError: the directory holds no checkpoint, or not ``step`` (the message lists the
            directory and the steps it holds).
          FileNotFoundError: an item's files are missing from the checkpoint (named).
          ValueError: the checkpoint does not match ``targets`` (e.g. another model's shapes).
        """
        ocp = _ocp()
        steps = self.all_steps()
        if not steps:
            raise CheckpointNotFoundError(f"no checkpoint in {self.directory} (no committed <step>/ directory)")
        step = steps[-1] if step is None else int(step)
        if step not in steps:
            raise CheckpointNotFoundError(f"no checkpoint for step {step} in {self.directory}; it holds steps "
                                          f"{steps}")
        path = os.path.join(self.directory, str(step))
        present = set(os.listdir(path))
        if "meta" not in present:
            raise FileNotFoundError(f"checkpoint {path} has no 'meta' item (incomplete or not an fp8rl_jax "
                                    f"checkpoint)")
        targets = targets or {}
        args = {"meta": ocp.args.JsonRestore()}
        for name in items:
            if name not in ITEMS:
                raise ValueError(f"unknown checkpoint item {name!r}; items are {ITEMS}")
            if name not in present:
                if name != "extra" or jax.tree.leaves(targets.get("extra", {})):
                    raise FileNotFoundError(f"checkpoint {path} is missing item {name!r} (expected directory "
                                            f"{os.path.join(path, name)})")
                continue
            tgt = targets.get(name)
            args[name] = ocp.args.StandardRestore(_abstract(tgt) if tgt is not None else None)
        try:
            out = dict(self._manager.restore(step, args=ocp.args.Composite(**args)))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"checkpoint {path} is missing a file: {e}") from e
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"checkpoint {path} does not match the model/optimizer being restored "
                             f"(different model, precision or optimizer?): {e}") from e
        for name, tgt in targets.items():  # orbax may hand back the saved shapes; the model must not take them
            if name in out and tgt is not None and jax.tree.leaves(tgt):
                _check_like(f"{path}/{name}", out[name], tgt)
        meta = dict(out.pop("meta"))
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"checkpoint {path} has format_version {meta.get('format_version')!r}; this "
                             f"code reads {FORMAT_VERSION}")
        return out, meta


def _check_like(where: str, got: Any, want: Any) -> None:
    """Raise ValueError naming the first leaf whose structure or shape differs between ``got`` and ``want``."""
    want_leaves = jax.tree_util.tree_flatten_with_path(want)[0]
    got_leaves = jax.tree.leaves(got)
    if len(want_leaves) != len(got_leaves):
        raise ValueError(f"checkpoint {where} does not match the model/optimizer being restored: "
                         f"{len(got_leaves)} arrays saved, {len(want_leaves)} expected")
    for (kp, w), g in zip(want_leaves, got_leaves):
        if tuple(np.shape(w)) != tuple(np.shape(g)):
            raise ValueError(f"checkpoint {where} does not match the model/optimizer being restored: "
                             f"{jax.tree_util.keystr(kp)} has shape {tuple(np.shape(g))}, expected "
                             f"{tuple(np.shape(w))}")


def model_state(model) -> dict:
    """The float master params of an NNX model as a nested pure dict (HF-named path keys)."""
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def optimizer_state(optimizer) -> dict:
    """The whole ``nnx.Optimizer`` state (optax state, step, loss scale) as a nested pure dict."""
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(optimizer))


def load_model_state(model, pure: dict) -> None:
    """Write a pure dict from :func:`model_state` (as restored) back into ``model`` in place."""
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)


def load_optimizer_state(optimizer, pure: dict) -> None:
    """Write a pure dict from :func:`optimizer_state` (as restored) back into ``optimizer`` in place."""
    from flax import nnx

    state = nnx.state(optimizer)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(optimizer, state)
