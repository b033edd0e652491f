"""The example notebooks (examples/*.ipynb): committed with the outputs of a run of the committed code, and each one
executes in a fresh kernel within its time budget with its own assertions passing (its last cells).

The execution tests carry the ``notebooks`` marker: ``make test`` runs them beside the main suite, in the lane that
first compiles the GPU programs (Makefile), since each takes a minute or two of one core.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
EXPECTED = ["correction", "mismatch", "quickstart", "sync"]
HANG_GUARD = 6  # a cell's wall-clock limit under `make test`, in budgets (the budget itself is checked on CPU time)


def _runner():
    spec = importlib.util.spec_from_file_location("run_notebooks", os.path.join(ROOT, "scripts", "run_notebooks.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _read(path):
    nbformat = pytest.importorskip("nbformat", reason="needs the [notebooks] extra")
    return nbformat.read(path, as_version=4)


def test_every_notebook_is_committed_with_the_outputs_of_its_code():
    """Each notebook's code cells ran once each, in order (execution counts 1..N), none produced an error, the
    recorded sha256 of the code equals the committed code's (outputs from this code, not an older version), and the
    recorded run stayed within the notebook's time budget."""
    run = _runner()
    paths = run.notebook_paths()
    assert sorted(os.path.basename(p)[:-6] for p in paths) == EXPECTED
    for path in paths:
        nb = _read(path)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), path
        errors = [o for c in code for o in c.outputs if o.output_type == "error"]
        assert not errors, (path, [e.get("ename") for e in errors])
        meta = nb.metadata.get("fp8rl", {})
        assert meta.get("source_sha256") == run.code_sha256(nb), f"{path}: outputs are not from the committed code " \
            "(re-run: python scripts/run_notebooks.py --write)"
        assert 0 < meta["executed_s"] <= run.budget_s(nb), path
        assert any(o.output_type == "display_data" and "image/png" in o.get("data", {}) for c in code
                   for o in c.outputs), f"{path}: no plot in the committed outputs"


@pytest.mark.notebooks
@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_runs_in_a_fresh_kernel_within_its_budget(name, monkeypatch):
    """Execute the notebook (nbclient, a new python3 kernel): any error or failed assertion in its last cells fails,
    and so does a notebook whose cost passes 1.5x its budget. The cost is the smaller of the wall time and the
    kernel's CPU time: alone on a machine the wall time is the smaller (the kernel's XLA runs on every core), while
    `make test` runs the notebooks beside two pytest workers on 2 cores, where the wall time measures the load and the
    CPU time still measures the notebook. For the same reason a cell's wall-clock limit here is a hang guard,
    HANG_GUARD x the budget, not the budget: in CI (stop 42) a cell of the 40-second correction notebook passed 180 s
    of wall time beside the 8-device tests. The kernel runs at XLA's default optimization, as a user's does (not the
    suite's cheap-compile TEST_XLA_FLAGS, tests/conftest.py): its budget is measured for what users run."""
    pytest.importorskip("nbclient", reason="needs the [notebooks] extra")
    pytest.importorskip("ipykernel", reason="needs the [notebooks] extra")
    from conftest import TEST_XLA_FLAGS, xla_flags_without

    monkeypatch.setenv("XLA_FLAGS", xla_flags_without(*TEST_XLA_FLAGS.split()))
    run = _runner()
    (path,) = run.notebook_paths([name])
    nb, wall, cpu = run.execute(path, cell_timeout_budgets=HANG_GUARD)
    print(f"{name}: {wall:.1f} s, kernel CPU {cpu:.1f} s")
    assert cpu > 0, "the kernel's CPU time was not measured"
    assert min(wall, cpu) <= run.budget_s(nb) * 1.5, \
        f"{name} took {wall:.0f} s wall, {cpu:.0f} s of kernel CPU (budget {run.budget_s(nb):.0f} s)"
