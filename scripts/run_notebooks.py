#!/usr/bin/env python
"""Execute the example notebooks (examples/*.ipynb) in fresh kernels; optionally rewrite them with their outputs.

    python scripts/run_notebooks.py                  # execute all, report times, change nothing
    python scripts/run_notebooks.py --write          # execute all and rewrite them with the new outputs
    python scripts/run_notebooks.py --only sync      # one notebook

Each notebook runs in a new ``python3`` kernel of this interpreter (nbclient), with ``examples/`` as the working
directory. A cell that raises, or runs longer than the notebook's budget (``metadata.fp8rl.time_budget_s``, default
180 s), fails the run. With ``--write`` the notebook is saved with its outputs and ``metadata.fp8rl`` records the
sha256 of its code cells (``source_sha256``), the wall time and the machine, so a test can check that the committed
outputs came from the committed code (tests/test_notebooks.py). Exit status 1 if any notebook failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
EXAMPLES = os.path.join(ROOT, "examples")
DEFAULT_BUDGET_S = 180.0


def code_sha256(nb) -> str:
    """sha256 of a notebook's code cells (sources joined with a NUL): what the committed outputs must come from."""
    src = "\0".join(c.source for c in nb.cells if c.cell_type == "code")
    return hashlib.sha256(src.encode("utf-8")).hexdigest()


def budget_s(nb) -> float:
    """The notebook's time budget in seconds (``metadata.fp8rl.time_budget_s``, default 180)."""
    return float(nb.metadata.get("fp8rl", {}).get("time_budget_s", DEFAULT_BUDGET_S))


def notebook_paths(only: list[str] | None = None) -> list[str]:
    """examples/*.ipynb, sorted; ``only`` filters by stem (ValueError naming an unknown one)."""
    names = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".ipynb"))
    if only:
        unknown = sorted(set(only) - {n[:-6] for n in names})
        if unknown:
            raise ValueError(f"no notebook {unknown} in {EXAMPLES} (have {[n[:-6] for n in names]})")
        names = [n for n in names if n[:-6] in only]
    return [os.path.join(EXAMPLES, n) for n in names]


def execute(path: str, cell_timeout_budgets: float = 1.0):
    """Execute one notebook in a fresh kernel (cwd = its folder), with a private temporary directory.

    A cell running longer than ``cell_timeout_budgets`` x the notebook's budget in wall time (default: the budget)
    is stopped and fails the run; tests/test_notebooks.py passes a larger factor, since it runs beside other load.

    The kernel's ``TMPDIR`` is a new directory removed once the kernel has stopped, so whatever the notebook writes
    through :mod:`tempfile` (run directories, a 1.4 GB checkpoint in the quickstart) is gone afterwards, also when a
    cell fails.

    Returns:
      ``(notebook with outputs, wall seconds, kernel CPU seconds)``: the CPU seconds are the user + system time of
      the kernel process and what it started (``getrusage(RUSAGE_CHILDREN)`` once nbclient has stopped and reaped
      it), a measure of the notebook's own work that other load on the machine does not inflate.

    Raises:
      nbclient.exceptions.CellExecutionError: a cell raised (the traceback is in the message).
      nbclient.exceptions.CellTimeoutError: a cell ran past ``cell_timeout_budgets`` x the budget.
    """
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    timeout = cell_timeout_budgets * budget_s(nb)
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.dirname(path)}})
    with tempfile.TemporaryDirectory(prefix="fp8rl_notebook_") as tmp:
        saved = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = tmp  # the kernel process inherits this environment when nbclient starts it
        try:
            client.execute()
        finally:
            if saved is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = saved
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return nb, wall, cpu


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", help="notebook stems (default: all)")
    p.add_argument("--write", action="store_true", help="rewrite the notebooks with their new outputs")
    args = p.parse_args(argv)
    import nbformat

    failed = []
    rows = []
    for path in notebook_paths(args.only):
        name = os.path.basename(path)
        try:
            nb, wall, cpu = execute(path)
        except Exception as e:  # noqa: BLE001 - report every notebook
            failed.append(name)
            print(f"FAILED {name}: {type(e).__name__}: {str(e)[-3000:]}", flush=True)
            continue
        rows.append((name, wall, budget_s(nb)))
        print(f"{name}: {wall:.1f} s, kernel CPU {cpu:.1f} s (budget {budget_s(nb):.0f} s)", flush=True)
        if args.write:
            meta = nb.metadata.setdefault("fp8rl", {})
            meta.update({"source_sha256": code_sha256(nb), "executed_s": round(wall, 1),
                         "executed_on": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
                         "executed_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
            meta.setdefault("time_budget_s", DEFAULT_BUDGET_S)
            nbformat.write(nb, path)
    print(json.dumps({"notebooks": {n: round(w, 1) for n, w, _ in rows}, "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
