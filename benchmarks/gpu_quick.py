"""Helpers of ``bash benchmarks/run_gpu.sh quick`` (one GPU slot): packages, self-tests, the GPU-test report.

Subcommands (``python benchmarks/gpu_quick.py <cmd> --help``):

* ``pack-list``: the distributions (``name==version``) the GPU machine's image lacks for the quick stages, for
  ``benchmarks/pack_gpu_tree.sh`` to download as wheels (:func:`needed_distributions`).
* ``site``: unpack the wheels of ``.whl/`` (made by ``benchmarks/pack_gpu_tree.sh``) whose packages this Python
  cannot import into a site folder for ``PYTHONPATH``; packages already installed are left alone
  (:func:`ensure_site`).
* ``check``: import what each quick stage needs and say, per stage, what is missing (:func:`check_requirements`).
* ``selftest``: every kernel family's self-test (:data:`fp8rl_jax.kernels.registry.FAMILIES`) on the GPU, with its
  seconds and error (:func:`run_selftests`).
* ``tests-report``: merge the per-file pytest results (JUnit XML, or the live report of a file cut by its time limit)
  into ``benchmarks/results/gpu_tests_<device>.json`` (:func:`gpu_tests_report`).

Only the standard library is imported at module level; ``check`` and ``selftest`` import JAX and the project.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import re
import sys
import time
import xml.etree.ElementTree as ET
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------------------------- wheels -> site


def wheel_modules(path: str) -> list[str]:
    """The importable top-level names a wheel provides: each package (outermost folder with an ``__init__.py``;
    inside a namespace folder such as ``google/`` its sub-packages, e.g. ``google.protobuf``) and each top-level
    module (``six.py``, an extension ``_cffi_backend.*.so``). Data and metadata folders are ignored.

    Raises:
      zipfile.BadZipFile: not a wheel.
    """
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if not n.endswith("/")]
    names = [re.sub(r"^[^/]+\.data/(purelib|platlib)/", "", n) for n in names]  # installed into site-packages too
    names = [n for n in names if not re.match(r"[^/]+\.(dist-info|data)/", n)]
    packages = sorted({"/".join(n.split("/")[:-1]) for n in names if n.endswith("/__init__.py")}, key=len)
    out: list[str] = []
    for p in packages:
        if not any(p == q or p.startswith(q + "/") for q in out):
            out.append(p)
    mods = [p.replace("/", ".") for p in out]
    for n in names:
        if "/" not in n and (n.endswith(".py") or n.endswith(".so")):
            mods.append(n.split(".")[0])
    return sorted(set(mods))


def wheel_fits(filename: str) -> tuple[bool, str]:
    """Whether this Python can use a wheel, from its file name's tags (``name-ver[-build]-py-abi-plat.whl``).

    Pure wheels (``py3-none-any``) fit everywhere; a binary wheel needs a ``linux`` platform tag naming this machine
    (``x86_64`` / ``aarch64``) and a CPython tag of this version (``cp312``) or a stable-ABI one (``abi3``) not newer.

    Returns:
      ``(fits, reason)``.
    """
    parts = os.path.basename(filename)[:-4].split("-")
    if len(parts) < 5:
        return False, f"not a wheel file name: {filename}"
    py, abi, plat = parts[-3], parts[-2], parts[-1]
    here = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    if plat == "any":
        ok = any(t in ("py3", here) or t.startswith(f"py{sys.version_info[0]}") for t in py.split("."))
        return ok, ("pure" if ok else f"python tag {py}")
    machine = platform.machine()
    if "linux" not in plat or machine not in plat:
        return False, f"platform {plat}, this machine is linux {machine}"
    if abi == "abi3":
        vers = [int(t[3:]) for t in py.split(".") if t.startswith("cp3")]
        ok = bool(vers) and min(vers) <= sys.version_info[1]
        return ok, ("abi3" if ok else f"needs {py}")
    return (here in py.split(".") and abi in (here, "none")), f"tags {py}-{abi}"


def ensure_site(wheel_dir: str, site_dir: str) -> list[dict]:
    """Unpack into ``site_dir`` each wheel of ``wheel_dir`` that provides a module this Python cannot import.

    A wheel all of whose modules (:func:`wheel_modules`) are importable already is skipped (the machine's own
    package wins, whatever its version); one that does not fit this Python (:func:`wheel_fits`) is reported and
    skipped. ``site_dir`` itself is taken off ``sys.path`` while checking, so an earlier unpack does not count.

    Returns:
      one ``{"wheel", "modules", "action": "present" | "unpacked" | "unusable", "detail"}`` per wheel.

    Raises:
      FileNotFoundError: ``wheel_dir`` does not exist.
    """
    if not os.path.isdir(wheel_dir):
        raise FileNotFoundError(f"no wheel folder {wheel_dir}: make it with `bash benchmarks/pack_gpu_tree.sh` on a "
                                "machine with a package registry, then carry it with the tree")
    site_abs = os.path.abspath(site_dir)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != site_abs]
    importlib.invalidate_caches()
    report = []
    for name in sorted(os.listdir(wheel_dir)):
        if not name.endswith(".whl"):
            continue
        path = os.path.join(wheel_dir, name)
        mods = wheel_modules(path)
        missing = []
        for m in [m for m in mods if not m.startswith(("test", "_"))] or mods:  # a wheel's own tests: not needed
            try:
                if importlib.util.find_spec(m) is None:
                    missing.append(m)
            except (ImportError, ValueError):
                missing.append(m)
        if mods and not missing:
            report.append({"wheel": name, "modules": mods, "action": "present", "detail": "installed here"})
            continue
        fits, why = wheel_fits(name)
        if not fits:
            report.append({"wheel": name, "modules": mods, "action": "unusable", "detail": why})
            continue
        os.makedirs(site_dir, exist_ok=True)
        with zipfile.ZipFile(path) as z:
            for member in z.namelist():  # as pip installs it: *.data/purelib|platlib/... at the top, other .data out
                target = re.sub(r"^[^/]+\.data/(purelib|platlib)/", "", member)
                if re.match(r"[^/]+\.data/", target) or member.endswith("/"):
                    continue
                dest = os.path.join(site_dir, target)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                with z.open(member) as src, open(dest, "wb") as dst:
                    dst.write(src.read())
        report.append({"wheel": name, "modules": mods, "action": "unpacked", "detail": f"missing {missing}"})
    return report


# ------------------------------------------------------------------------------------- what the pack must carry

#: distributions the GPU machine's image has (shared/GPU.md: jax 0.11.2 with its CUDA plugin, flax, optax, torch,
#: pytest, numpy, ml_dtypes), each with everything it requires: never packed
IMAGE_DISTS = ("jax", "jaxlib", "flax", "optax", "numpy", "ml_dtypes", "torch", "pytest")
#: what the quick stages import beyond the test files (the trainer's whole import chain, the chain_sum task and
#: reward, the tokenizer and checkpoint readers, the benchmarks' and the receivers' modules)
PACK_IMPORTS = ("fp8rl_jax.trainer", "fp8rl_jax.trainer.run", "fp8rl_jax.trainer.loop", "fp8rl_jax.trainer.logging",
                "fp8rl_jax.trainer.checkpoint", "fp8rl_jax.trainer.progress", "fp8rl_jax.trainer.cli",
                "fp8rl_jax.models.synthetic", "fp8rl_jax.models.hf_io", "fp8rl_jax.models.tokenizer",
                "fp8rl_jax.export", "fp8rl_jax.rollout.engine", "rollout_bridge.dlpack",
                "rollout_bridge.torch_receiver", "safetensors.numpy", "tensorboardX", "tqdm.auto", "jinja2.sandbox",
                "gin")


def _requirement_names(dist: str) -> list[str]:
    """The distributions ``dist`` requires unconditionally (extras left out; other markers evaluated here)."""
    import importlib.metadata as md

    try:
        from packaging.markers import Marker
    except ImportError:  # pip's own copy
        from pip._vendor.packaging.markers import Marker
    out = []
    for req in md.requires(dist) or []:
        spec, _, marker = req.partition(";")
        if marker.strip():
            if "extra" in marker:
                continue
            try:
                if not Marker(marker.strip()).evaluate():
                    continue
            except Exception:  # noqa: BLE001 - an unparsable marker: keep the requirement
                pass
        name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
        if name:
            out.append(name.group(1))
    return out


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_closure(roots) -> set[str]:
    """Canonical names of ``roots`` and everything they require, transitively, among the installed distributions
    (a requirement that is not installed here ends the walk on that branch)."""
    import importlib.metadata as md

    seen, todo = set(), [*roots]
    while todo:
        d = todo.pop()
        c = _canon(d)
        if c in seen:
            continue
        seen.add(c)
        try:
            todo += _requirement_names(d)
        except md.PackageNotFoundError:
            pass
    return seen


def needed_distributions(imports=PACK_IMPORTS, image=IMAGE_DISTS, project="fp8rl-jax") -> list[tuple[str, str]]:
    """The installed distributions the GPU machine lacks for the quick stages, as ``(name, version)``.

    Imports ``imports`` (and builds the chain_sum dataset and scores one answer, which imports reasoning-gym's tasks),
    then keeps each distribution that (1) provides a module now loaded, (2) is in the requirement closure of the
    project's own dependencies (so an optional import that merely succeeded here, such as IPython, is left out) and
    (3) is not in the closure of the image's distributions (:data:`IMAGE_DISTS`).

    Raises:
      ImportError: one of ``imports`` cannot be imported here (the environment lacks the project's dependencies).
    """
    import importlib.metadata as md

    sys.path.insert(0, ROOT)
    for m in imports:
        importlib.import_module(m)
    from fp8rl_jax.data import get_reward_fn, make_train_dataset

    item = next(iter(make_train_dataset("chain_sum", 0).iterate_batches(1, seed=0)))[0]
    get_reward_fn("chain_sum")("7", item)
    loaded = {m.split(".")[0] for m in list(sys.modules)}
    provided = md.packages_distributions()
    dists = {d for top in loaded for d in provided.get(top, [])}
    wanted = requirement_closure(_requirement_names(project)) - requirement_closure(image)
    out = sorted((d, md.version(d)) for d in dists if _canon(d) in wanted)
    return out


# ------------------------------------------------------------------------------------------ requirements check

#: what each stage of ``run_gpu.sh quick`` imports (the project modules pull in their own dependencies)
STAGE_MODULES = {
    "selftest": ["jax", "numpy", "ml_dtypes", "fp8rl_jax.kernels.registry"],
    "tests": ["pytest", "torch", "flax", "fp8rl_jax.fp8.linear", "fp8rl_jax.models.decoder", "rollout_bridge.cpu_gemm"],
    "rollout": ["flax", "fp8rl_jax.export", "fp8rl_jax.rollout.engine"],
    "gemm": ["fp8rl_jax.fp8.linear", "fp8rl_jax.kernels.pallas_gemm"],
    "sync": ["torch", "fp8rl_jax.export", "rollout_bridge.dlpack", "rollout_bridge.torch_receiver"],
    "train": ["gin", "tokenizers", "safetensors", "jinja2", "reasoning_gym", "tensorboardX", "tqdm", "optax",
              "orbax.checkpoint", "fp8rl_jax.trainer", "fp8rl_jax.trainer.run", "fp8rl_jax.models.synthetic"],
}


def check_requirements(stages=None) -> dict:
    """Import every module each stage needs (:data:`STAGE_MODULES`) and whether JAX sees a GPU.

    Returns:
      ``{"gpu": device kind or None, "jax": version or None, "stages": {stage: {"ok": bool, "missing":
      {module: error}}}}``; an import that raises anything counts as missing, with its error.
    """
    stages = list(stages or STAGE_MODULES)
    errors: dict[str, str] = {}

    def importable(mod):
        if mod not in errors:
            try:
                importlib.import_module(mod)
                errors[mod] = ""
            except BaseException as e:  # noqa: BLE001 - a broken package can raise anything at import
                errors[mod] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        return not errors[mod]

    out = {"gpu": None, "jax": None, "stages": {}}
    if importable("jax"):
        import jax

        out["jax"] = jax.__version__
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        out["gpu"] = gpus[0].device_kind if gpus else None
    for st in stages:
        missing = {m: errors[m] for m in STAGE_MODULES[st] if not importable(m)}
        out["stages"][st] = {"ok": not missing, "missing": missing}
    return out


# ------------------------------------------------------------------------------------------------- self-tests


def run_selftests() -> dict:
    """Run every kernel family's self-test once in this process (``registry.kernel_mode_scope("auto")``).

    Imports every module of ``fp8rl_jax.fp8`` and ``fp8rl_jax.kernels`` and ``fp8rl_jax.models.attention_impl`` first (each registers its
    family's self-test at import; an import error is recorded). Without a CUDA device nothing is tested
    (``"tested": False``): :func:`fp8rl_jax.kernels.registry.selftest_passed` passes trivially there.

    Returns:
      ``{"device", "jax", "tested", "families": {family: {"passed", "seconds", "error"}}, "import_errors",
      "warnings"}``.
    """
    import pkgutil
    import warnings

    import jax

    import fp8rl_jax.fp8 as fp8_pkg
    import fp8rl_jax.kernels as kernels_pkg
    from fp8rl_jax.kernels import registry

    import_errors = {}
    mods = [f"{pkg.__name__}.{m.name}" for pkg in (fp8_pkg, kernels_pkg) for m in pkgutil.iter_modules(pkg.__path__)]
    for mod in [*mods, "fp8rl_jax.models.attention_impl"]:
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 - recorded, the families of the other modules still run
            import_errors[mod] = f"{type(e).__name__}: {e}"
    dev = registry.cuda_device()
    res = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with registry.kernel_mode_scope("auto"):
            for fam in registry.FAMILIES:
                t = time.perf_counter()
                ok = bool(registry.selftest_passed(fam))
                res[fam] = {"passed": ok and dev is not None, "seconds": round(time.perf_counter() - t, 2),
                            "error": registry.selftest_failures().get(fam) or (None if dev else "no CUDA device")}
                print(f"selftest {fam}: {'pass' if res[fam]['passed'] else 'FAIL'} ({res[fam]['seconds']} s)"
                      + (f": {res[fam]['error']}" if res[fam]["error"] else ""), flush=True)
    return {"device": dev.device_kind if dev is not None else jax.devices()[0].device_kind, "jax": jax.__version__,
            "tested": dev is not None, "families": res, "import_errors": import_errors,
            "warnings": sorted({f"{w.category.__name__}: {w.message} ({os.path.basename(w.filename)}:{w.lineno})"
                                for w in caught})}


# ------------------------------------------------------------------------------------------------ test report


def _nodeid(classname: str, name: str, file: str | None) -> str:
    """pytest's node id of a JUnit ``testcase`` (``classname`` is the dotted module path, plus a class)."""
    if file:
        mod = file[:-3].replace("/", ".") if file.endswith(".py") else file.replace("/", ".")
        if classname == mod:
            return f"{file}::{name}"
        if classname.startswith(mod + "."):
            return f"{file}::{classname[len(mod) + 1:].replace('.', '::')}::{name}"
    return f"{classname}::{name}" if classname else name


def junit_results(xml_path: str, file: str | None = None) -> list[dict]:
    """The test cases of a pytest ``--junitxml`` file.

    Args:
      xml_path: the XML file. file: the test file the run was given (``tests/test_x.py``), to spell node ids.

    Returns:
      ``[{"test": node id, "outcome": "passed" | "failed" | "skipped" | "xfailed", "message", "seconds"}]``;
      ``failed`` covers ``<failure>`` and ``<error>`` (a collection or setup error too), ``xfailed`` a skip of type
      ``pytest.xfail``; ``message`` is the element's ``message`` attribute (or its text's last lines).

    Raises:
      ET.ParseError: not XML (a file cut mid-write).
    """
    out = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        test = _nodeid(case.get("classname", ""), case.get("name", ""), file)
        bad = [e for e in case if e.tag in ("failure", "error")]
        skip = [e for e in case if e.tag == "skipped"]
        if bad:
            e = bad[0]
            msg = (e.get("message") or "").strip() or "\n".join((e.text or "").strip().splitlines()[-20:])
            outcome = "failed"
        elif skip:
            e = skip[0]
            msg = (e.get("message") or "").strip()
            outcome = "xfailed" if e.get("type") == "pytest.xfail" else "skipped"
        else:
            outcome, msg = "passed", ""
        out.append({"test": test, "outcome": outcome, "message": msg[:4000], "seconds": float(case.get("time") or 0)})
    return out


def live_results(path: str) -> list[dict]:
    """The tests a :mod:`pytest_live_report` file recorded (same form as :func:`junit_results`); a test with any
    failed phase is failed, else skipped (``xfailed`` for an expected failure) if a phase skipped, else passed.
    A last line cut mid-write is ignored."""
    by: dict[str, dict] = {}
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            cur = by.setdefault(r["nodeid"], {"test": r["nodeid"], "outcome": "passed", "message": "", "seconds": 0.0})
            cur["seconds"] += float(r.get("duration") or 0)
            if r["outcome"] == "failed":
                cur["outcome"], cur["message"] = "failed", f"{r['when']}: {r.get('message', '')}"
            elif r["outcome"] == "skipped" and cur["outcome"] != "failed":
                cur["outcome"] = "xfailed" if r.get("xfail") else "skipped"
                cur["message"] = r.get("message", "")
    return list(by.values())


def device_slug(device: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia_h200"`` (file-name safe)."""
    return re.sub(r"_+", "_", "".join(c if c.isalnum() else "_" for c in device.lower())).strip("_") or "unknown"


def gpu_tests_report(runs: list[dict], device: str, jax_version: str, seconds: float,
                     skip_is_failure: bool = True) -> dict:
    """The GPU-test summary ``{"device", "jax", "passed", "failed", "skipped", "seconds", "failures": [{"test",
    "message"}]}`` (plus ``xfailed``, ``ok`` and a per-file breakdown ``files``) from one pytest run per file.

    Args:
      runs: per test file ``{"file", "rc", "seconds", "junit": xml path or None, "live": live-report path or None,
        "log": log path or None, "limit": its time limit in seconds or None}``. A file with a readable JUnit XML is
        read from it; otherwise from its live report, and the file itself is a failure (cut by its time limit, exit
        124/137, or ended without a report: the log's last lines are the message).
      device, jax_version: recorded as given. seconds: wall seconds of the whole stage.
      skip_is_failure: a skip is a failure (on a GPU machine every GPU test must run): it is listed in
        ``failures`` with ``"SKIPPED on a GPU machine"``, and ``ok`` is False.

    Returns:
      the summary; ``failed`` counts failed and errored tests plus files that failed as a whole.
    """
    counts = {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0}
    failures, files = [], {}
    for run in runs:
        file, rc = run["file"], run.get("rc")
        cases, whole = None, None
        if run.get("junit") and os.path.isfile(run["junit"]):
            try:
                cases = junit_results(run["junit"], file)
            except ET.ParseError as e:
                whole = f"unreadable JUnit XML {run['junit']}: {e}"
        if cases is None:
            cases = live_results(run["live"]) if run.get("live") and os.path.isfile(run["live"]) else []
            if whole is None:
                if rc in (124, 137):
                    whole = (f"cut by its {run.get('limit') or '?'} s time limit (exit {rc}) after "
                             f"{run.get('seconds', 0):.0f} s; {len(cases)} tests reported before the cut, the rest "
                             "never ran")
                else:
                    tail = ""
                    if run.get("log") and os.path.isfile(run["log"]):
                        with open(run["log"], errors="replace") as f:
                            tail = "".join(f.readlines()[-15:]).strip()
                    whole = f"pytest exited {rc} without a JUnit report" + (f": {tail}" if tail else "")
        if rc == 5 and not cases:
            whole = "no GPU test collected (pytest exit 5) although the file has GPU-marked tests"
        fc = {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0}
        for c in cases:
            fc[c["outcome"]] += 1
            if c["outcome"] == "failed":
                failures.append({"test": c["test"], "message": c["message"]})
            elif c["outcome"] == "skipped" and skip_is_failure:
                failures.append({"test": c["test"], "message": f"SKIPPED on a GPU machine (counts as a failure): "
                                                               f"{c['message']}"})
        if whole:
            fc["failed"] += 1
            failures.append({"test": file, "message": whole})
        for k in counts:
            counts[k] += fc[k]
        files[file] = {**fc, "rc": rc, "seconds": run.get("seconds"), "limit": run.get("limit")}
    ok = counts["failed"] == 0 and counts["passed"] > 0 and not (skip_is_failure and counts["skipped"])
    return {"device": device, "jax": jax_version, **counts, "seconds": round(float(seconds), 1), "ok": ok,
            "failures": failures, "files": files}


def _read_runs(tsv: str, folder: str) -> list[dict]:
    """``run_gpu.sh``'s per-file lines ``file<TAB>rc<TAB>seconds<TAB>limit`` -> :func:`gpu_tests_report` runs
    (JUnit XML, live report and log in ``folder`` under the file's base name)."""
    runs = []
    with open(tsv) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 3:
                continue
            file, rc, secs = parts[0], int(parts[1]), float(parts[2])
            limit = float(parts[3]) if len(parts) > 3 and parts[3] else None
            base = os.path.join(folder, os.path.basename(file)[:-3])
            runs.append({"file": file, "rc": rc, "seconds": secs, "limit": limit, "junit": base + ".xml",
                         "live": base + ".jsonl", "log": base + ".log"})
    return runs


# ------------------------------------------------------------------------------------------------------- CLI


def main(argv=None) -> int:
    """Command line: see the module docstring. Returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("site", help="unpack the wheels whose packages are missing")
    p.add_argument("--wheels", default=os.path.join(ROOT, ".whl"))
    p.add_argument("--site", default=os.path.join(ROOT, ".whl", "site"))
    sub.add_parser("pack-list", help="print name==version of each distribution the GPU machine lacks (for pip)")
    p = sub.add_parser("check", help="what each quick stage needs, importable or not")
    p.add_argument("--out", default=None, help="also write the result as JSON here")
    p = sub.add_parser("selftest", help="every kernel family's self-test")
    p.add_argument("--out", default=None, help="also write the result as JSON here")
    p.add_argument("--allow_cpu", action="store_true", help="exit 0 without a CUDA device (nothing tested)")
    p = sub.add_parser("tests-report", help="merge per-file pytest results into gpu_tests_<device>.json")
    p.add_argument("--runs", required=True, help="TSV: file, exit status, seconds, limit (one line per file)")
    p.add_argument("--dir", required=True, help="folder of the per-file .xml / .jsonl / .log")
    p.add_argument("--seconds", type=float, required=True, help="wall seconds of the stage")
    p.add_argument("--device", default=None, help="device name (default: JAX's first GPU, else its first device)")
    p.add_argument("--jax", default=None, help="jax version (default: the installed one)")
    p.add_argument("--out", default=None, help="default benchmarks/results/gpu_tests_<device>.json")
    p.add_argument("--skips_pass", action="store_true", help="a skip is not a failure (a machine without a GPU)")
    args = ap.parse_args(argv)
    if args.cmd == "site":
        try:
            rep = ensure_site(args.wheels, args.site)
        except FileNotFoundError as e:
            print(f"gpu_quick site: {e}", file=sys.stderr)
            return 1
        for r in rep:
            print(f"{r['action']:9s} {r['wheel']} ({', '.join(r['modules'])}): {r['detail']}")
        return 1 if any(r["action"] == "unusable" for r in rep) else 0
    if args.cmd == "pack-list":
        for name, version in needed_distributions():
            print(f"{name}=={version}")
        return 0
    if args.cmd == "check":
        sys.path.insert(0, ROOT)
        res = check_requirements()
        print(f"jax {res['jax']}, GPU: {res['gpu'] or 'NONE (JAX sees no GPU)'}")
        for st, r in res["stages"].items():
            missing = "; ".join(f"{m} ({e})" for m, e in r["missing"].items())
            print(f"{st:9s} {'ok' if r['ok'] else 'MISSING ' + missing}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=2)
        return 0 if res["gpu"] else 1
    if args.cmd == "selftest":
        sys.path.insert(0, ROOT)
        res = run_selftests()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=2)
        for w in res["warnings"]:
            print(f"warning during the self-tests: {w}")
        for m, e in res["import_errors"].items():
            print(f"import error: {m}: {e}")
        if not res["tested"]:
            print("no CUDA device: no self-test ran")
            return 0 if args.allow_cpu else 1
        return 0 if all(r["passed"] for r in res["families"].values()) and not res["import_errors"] else 1
    # tests-report
    device, jax_version = args.device, args.jax
    if device is None or jax_version is None:
        import jax

        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        device = device or (gpus[0] if gpus else jax.devices()[0]).device_kind
        jax_version = jax_version or jax.__version__
    rep = gpu_tests_report(_read_runs(args.runs, args.dir), device, jax_version, args.seconds,
                           skip_is_failure=not args.skips_pass)
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"gpu_tests_{device_slug(device)}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(rep, f, indent=2)
    print(f"GPU tests on {device} (jax {jax_version}): {rep['passed']} passed, {rep['failed']} failed, "
          f"{rep['skipped']} skipped, {rep['xfailed']} xfailed in {rep['seconds']:.0f} s -> {out}")
    for fl in rep["failures"]:
        print(f"  FAIL {fl['test']}: {fl['message'].splitlines()[0] if fl['message'] else ''}")
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
