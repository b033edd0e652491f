"""``bash benchmarks/run_gpu.sh quick`` and its helpers, checked on the CPU (no GPU needed).

The script's syntax and its stage plan (limits within the 480 s budget), the GPU-test report built from real pytest
JUnit XML and live-report files, the wheel unpacking for the GPU machine, the training smoke run's metrics checker
(and, marked slow, the smoke run itself for one step), the queue stage's per-script limit, and the loop that
``bench_fp8_matmul.py --loop`` times.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
RUN_GPU = os.path.join(BENCH, "run_gpu.sh")
sys.path.insert(0, BENCH)

import gpu_quick  # noqa: E402
from gpu_train_smoke import check_metrics  # noqa: E402

#: the quick stages in the order issues 36 and 37 ask for them (env first: packages and the import check; the
#: autotuner's sweep its own stage, before every stage that runs an FP8 kernel)
QUICK_ORDER = ["env", "selftest", "autotune", "tests", "rollout", "gemm", "sync", "train", "queue"]


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, BENCH, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def test_scripts_parse():
    for script in (RUN_GPU, os.path.join(BENCH, "pack_gpu_tree.sh")):
        r = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_quick_plan_fits_the_budget():
    r = subprocess.run(["bash", RUN_GPU, "plan"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.strip()]
    stages = [(name, int(secs)) for name, secs, unit in (row[:3] for row in rows if row[0] != "total")]
    assert [s for s, _ in stages] == QUICK_ORDER
    assert all(secs > 0 for _, secs in stages)
    total = sum(secs for _, secs in stages)
    assert total <= 480, f"quick stages sum to {total} s > 480 s"
    total_row = next(row for row in rows if row[0] == "total")
    assert int(total_row[1]) == total and "480" in " ".join(total_row)


def test_quick_rejects_an_unknown_stage(tmp_path):
    r = subprocess.run(["bash", RUN_GPU, "quick", "nonsense"], capture_output=True, text=True, timeout=30,
                       env=_env(OUT=str(tmp_path)))
    assert r.returncode == 2 and "unknown stage 'nonsense'" in r.stdout


TINY_TESTS = '''
import pytest

def test_ok():
    assert 1 + 1 == 2

def test_bad():
    assert 2 + 2 == 5, "arithmetic is broken here"

@pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
def test_skipped():
    pass
'''


@pytest.fixture(scope="module")
def tiny_pytest_run(tmp_path_factory):
    """A real pytest run of a file with one pass, one fail and one skip: its JUnit XML and live report."""
    d = tmp_path_factory.mktemp("tiny")
    (d / "test_tiny.py").write_text(TINY_TESTS)
    xml, live = d / "test_tiny.xml", d / "test_tiny.jsonl"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_live_report",
                        f"--junitxml={xml}", "test_tiny.py"], cwd=d, capture_output=True, text=True, timeout=120,
                       env=_env(PYTEST_LIVE_REPORT=str(live)))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "LIVE FAIL test_tiny.py::test_bad" in r.stdout  # printed as it happened
    return d, xml, live


def test_junit_results_read_a_real_pytest_report(tiny_pytest_run):
    _, xml, live = tiny_pytest_run
    got = {c["test"]: c for c in gpu_quick.junit_results(str(xml), "test_tiny.py")}
    assert {k: v["outcome"] for k, v in got.items()} == {
        "test_tiny.py::test_ok": "passed", "test_tiny.py::test_bad": "failed", "test_tiny.py::test_skipped": "skipped"}
    assert "arithmetic is broken here" in got["test_tiny.py::test_bad"]["message"]
    assert "needs a CUDA GPU" in got["test_tiny.py::test_skipped"]["message"]
    live_got = {c["test"]: c["outcome"] for c in gpu_quick.live_results(str(live))}
    assert live_got == {k: v["outcome"] for k, v in got.items()}


def test_gpu_tests_report_counts_and_failures(tiny_pytest_run, tmp_path):
    _, xml, live = tiny_pytest_run
    run = {"file": "test_tiny.py", "rc": 1, "seconds": 2.0, "junit": str(xml), "live": str(live), "limit": 100}
    rep = gpu_quick.gpu_tests_report([run], "NVIDIA H100 80GB HBM3", "0.11.2", 3.0)
    assert {k: rep[k] for k in ("device", "jax", "passed", "failed", "skipped", "seconds")} == {
        "device": "NVIDIA H100 80GB HBM3", "jax": "0.11.2", "passed": 1, "failed": 1, "skipped": 1, "seconds": 3.0}
    fails = {f["test"]: f["message"] for f in rep["failures"]}
    assert "arithmetic is broken here" in fails["test_tiny.py::test_bad"]
    assert fails["test_tiny.py::test_skipped"].startswith("SKIPPED on a GPU machine")  # a skip is a failure there
    assert rep["ok"] is False
    lenient = gpu_quick.gpu_tests_report([run], "cpu", "x", 3.0, skip_is_failure=False)
    assert [f["test"] for f in lenient["failures"]] == ["test_tiny.py::test_bad"]

    # a file cut by its time limit: no XML, the live report gives the tests that finished, the file itself fails
    cut = dict(run, junit=str(tmp_path / "missing.xml"), rc=124, seconds=100.0)
    rep = gpu_quick.gpu_tests_report([cut], "NVIDIA H200", "0.11.2", 100.0)
    assert (rep["passed"], rep["skipped"], rep["failed"]) == (1, 1, 2)
    assert any(f["test"] == "test_tiny.py" and "cut by its 100 s time limit" in f["message"] for f in rep["failures"])


def test_tests_report_cli_writes_the_json(tiny_pytest_run, tmp_path):
    d, xml, live = tiny_pytest_run
    folder = tmp_path / "tests"
    folder.mkdir()
    for src in (xml, live):
        (folder / src.name).write_bytes(src.read_bytes())
    (folder / "runs.tsv").write_text("tests/test_tiny.py\t1\t2\t100\n")
    out = tmp_path / "gpu_tests_x.json"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_quick.py"), "tests-report", "--runs",
                        str(folder / "runs.tsv"), "--dir", str(folder), "--seconds", "5", "--device", "NVIDIA H200",
                        "--jax", "0.11.2", "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr  # a failure and a skip
    rep = json.loads(out.read_text())
    assert set(rep) >= {"device", "jax", "passed", "failed", "skipped", "seconds", "failures"}
    assert (rep["passed"], rep["failed"], rep["skipped"]) == (1, 1, 1)
    assert gpu_quick.device_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"


def _wheel(path, files):
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return str(path)


def test_wheel_modules_and_tags(tmp_path):
    w = _wheel(tmp_path / "demo-1.0-py3-none-any.whl", {
        "demo/__init__.py": "", "demo/sub/__init__.py": "", "nspkg/inner/__init__.py": "", "single.py": "",
        "demo-1.0.dist-info/METADATA": "", "demo-1.0.data/scripts/x": ""})
    assert gpu_quick.wheel_modules(w) == ["demo", "nspkg.inner", "single"]
    assert gpu_quick.wheel_fits("demo-1.0-py3-none-any.whl")[0]
    here = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    import platform

    m = platform.machine()
    assert gpu_quick.wheel_fits(f"x-1-{here}-{here}-manylinux_2_17_{m}.whl")[0]
    assert gpu_quick.wheel_fits(f"x-1-cp38-abi3-manylinux2014_{m}.whl")[0]
    assert not gpu_quick.wheel_fits(f"x-1-cp99-cp99-manylinux_2_17_{m}.whl")[0]
    assert not gpu_quick.wheel_fits(f"x-1-{here}-{here}-win_amd64.whl")[0]


def test_ensure_site_unpacks_only_what_is_missing(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels / "fp8rl_absent_pkg-1.0-py3-none-any.whl", {"fp8rl_absent_pkg/__init__.py": "X = 42\n"})
    _wheel(wheels / "json-9.9-py3-none-any.whl", {"json/__init__.py": "raise ImportError('shadowed!')\n"})
    _wheel(wheels / "fp8rl_datalib-1.0-py3-none-any.whl", {"fp8rl_datalib-1.0.data/purelib/fp8rl_datalib.py": "Y = 1\n",
                                                          "fp8rl_datalib-1.0.data/scripts/tool": "#!/bin/sh\n"})
    site = tmp_path / "site"
    rep = {r["wheel"].split("-")[0]: r for r in gpu_quick.ensure_site(str(wheels), str(site))}
    assert rep["fp8rl_absent_pkg"]["action"] == "unpacked" and (site / "fp8rl_absent_pkg" / "__init__.py").is_file()
    assert rep["json"]["action"] == "present" and not (site / "json").exists()  # the machine's own json stays
    assert rep["fp8rl_datalib"]["action"] == "unpacked" and (site / "fp8rl_datalib.py").read_text() == "Y = 1\n"
    assert not any(p.name.endswith(".data") for p in site.iterdir())  # scripts and other .data folders: not imports
    with pytest.raises(FileNotFoundError, match="pack_gpu_tree.sh"):
        gpu_quick.ensure_site(str(tmp_path / "nowhere"), str(site))


def _metrics(tmp_path, rows):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


def _good_rows(n=3):
    return [{"step": 0, "val/x/acc": 0.0}] + [
        {"step": s, "reward/mean": -0.5, "actor/loss": 0.1 * s, "actor/pg_loss": 0.1, "actor/grad_norm": 1.5,
         "rollout_corr/k3_kl": 1e-4, "sync/probe_abs_diff": 0.02} for s in range(1, n + 1)]


def test_train_checker_accepts_a_good_run_and_rejects_bad_ones(tmp_path):
    assert check_metrics(_metrics(tmp_path, _good_rows()), 3, probe_tolerance=0.2) == []

    def problems(mutate, steps=3):
        rows = _good_rows()
        mutate(rows)
        return " | ".join(check_metrics(_metrics(tmp_path, rows), steps, probe_tolerance=0.2))

    assert "step 2: actor/loss = nan is not finite" in problems(lambda r: r[2].update({"actor/loss": math.nan}))
    assert "rollout_corr/k3_kl = inf" in problems(lambda r: r[1].update({"rollout_corr/k3_kl": math.inf}))
    assert "step 3: sync/probe_abs_diff = None" in problems(lambda r: r[3].pop("sync/probe_abs_diff"))
    assert "not content-checked" in problems(lambda r: r[1].update({"sync/probe_abs_diff": math.nan}))
    assert "exceeds the tolerance" in problems(lambda r: r[1].update({"sync/probe_abs_diff": 0.5}))
    assert "step 1: no actor/loss" in problems(lambda r: r[1].pop("actor/loss"))
    assert "expected 1..4" in problems(lambda r: None, steps=4)
    assert "weights never changed" in problems(lambda r: [x.update({"actor/grad_norm": 0.0}) for x in r[1:]])
    assert "no metrics file" in check_metrics(str(tmp_path / "none.jsonl"), 1)[0]


@pytest.mark.slow
def test_train_smoke_stage_runs_on_the_cpu(tmp_path):
    """The quick mode's train stage itself (scripts/train.py, FP8 rollout, content-checked sync), 1 step (~45 s)."""
    out = tmp_path / "smoke"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_train_smoke.py"), "--out", str(out), "--steps", "1",
                        "--prompts", "2", "--samples", "4", "--max_tokens", "8"], capture_output=True, text=True,
                       timeout=600, env=_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "train_smoke.json").read_text())
    assert res["passed"] and res["problems"] == [] and len(res["steps"]) == 1
    step = res["steps"][0]
    assert 0 <= step["sync/probe_abs_diff"] <= res["probe_tolerance"] and math.isfinite(step["actor/loss"])
    assert (out / "model" / "tokenizer.json").is_file() and (out / "model" / "config.json").is_file()


def test_quick_queue_stage_limits_each_script_and_keeps_its_output(tmp_path):
    q = tmp_path / "queue"
    q.mkdir()
    (q / "01_write.py").write_text(textwrap.dedent("""
        import json, os
        json.dump({"ok": 1}, open(os.path.join(os.environ["OUT"], "result.json"), "w"))
        print("wrote", flush=True)
    """))
    (q / "02_hang.sh").write_text("echo started; sleep 60; echo never\n")
    (q / "_parked.py").write_text("raise SystemExit('a parked script ran')\n")
    (q / "README.md").write_text("not a script\n")
    out = tmp_path / "out"
    r = subprocess.run(["bash", RUN_GPU, "quick", "queue"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=_env(OUT=str(out), GPU_QUEUE_DIR=str(q), GPU_QUEUE_SCRIPT_LIMIT="3",
                                GPU_QUICK_ALLOW_CPU="1", PY=sys.executable))
    assert r.returncode == 1, r.stdout + r.stderr  # the hanging script was cut
    assert json.loads((out / "queue" / "01_write" / "result.json").read_text()) == {"ok": 1}
    assert "02_hang.sh: exit 124" in r.stdout and "never" not in (out / "queue" / "02_hang.log").read_text()
    assert "parked" not in r.stdout
    summary = json.loads((out / "quick_summary.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == ["queue"] and summary["stages"][0]["rc"] == 1
    assert summary["stages"][0]["limit"] <= 480


def test_bench_fp8_matmul_loop_runs_every_call():
    """``--loop``: the compiled fori_loop keeps the GEMM inside the loop body (not hoisted as loop-invariant), and
    computes what calling the function n times with the carried activations does."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench_fp8_matmul import looped

    f = jax.jit(lambda a, b: a @ b)
    a = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)
    b = jnp.asarray(np.random.default_rng(1).standard_normal((8, 16)), jnp.float32)
    g = looped(f, 7)
    want, x = None, np.asarray(a)
    for _ in range(7):
        want = np.asarray(f(jnp.asarray(x), b))
        x = x.copy()
        x[0, 0] = want[0, 0]
    np.testing.assert_allclose(np.asarray(g(a, b)), want, rtol=1e-6)
    hlo = g.lower(a, b).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    assert " while(" in hlo
    assert " dot(" not in entry and "dot_general" not in entry, "the GEMM was hoisted out of the loop:\n" + entry


def test_random_model_dir_loads_like_a_checkpoint_and_its_eos_bias_works(tmp_path):
    """fp8rl_jax.models.synthetic: the HF directory the train stage uses loads through the trainer's own readers; the
    eos bias raises the eos probability far above 1/vocab (responses of varied length), without it it stays there."""
    import jax.numpy as jnp
    import numpy as np

    from fp8rl_jax.models.loading import build_model, load_checkpoint, load_tokenizer_for
    from fp8rl_jax.models.synthetic import TINY_QWEN3, write_random_model_dir

    def p_eos(eos_bias):
        d = write_random_model_dir(tmp_path / f"m{eos_bias}", seed=0, eos_bias=eos_bias)
        cfg, params = load_checkpoint(d)
        tok = load_tokenizer_for(d)
        ids = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=True)
        out = build_model(cfg, params)(jnp.asarray([ids]))
        logits = np.asarray(out[0] if isinstance(out, tuple) else out, np.float64)[0]
        p = np.exp(logits - logits.max(-1, keepdims=True))
        return cfg, tok, (p / p.sum(-1, keepdims=True))[:, tok.eos_token_id].mean()

    cfg, tok, plain = p_eos(0.0)
    assert cfg.model_type == "qwen3" and cfg.qk_norm and cfg.vocab_size == TINY_QWEN3["vocab_size"]
    assert tok.vocab_size == 259 and tok.eos_token_id == 2 == cfg.eos_token_id and tok.pad_token_id == 0
    assert tok.decode(tok.encode("12 + 7 = 19")) == "12 + 7 = 19"
    assert plain < 3.0 / cfg.vocab_size
    _, _, biased = p_eos(5.0)
    assert biased > 0.05


def test_quick_autotune_stage_hands_its_cache_to_the_later_stages_read_only(tmp_path):
    """The autotune stage (benchmarks/autotune_sweep.py; no GPU here: it says so and passes) points every later stage
    at its cache with FP8RL_AUTOTUNE=cached, so no later stage spends its time tuning."""
    q = tmp_path / "queue"
    q.mkdir()
    (q / "01_env.sh").write_text('echo "mode=$FP8RL_AUTOTUNE cache=$FP8RL_AUTOTUNE_CACHE"\n')
    out = tmp_path / "out"
    env = _env(OUT=str(out), GPU_QUEUE_DIR=str(q), GPU_QUICK_ALLOW_CPU="1", PY=sys.executable)
    env.pop("FP8RL_AUTOTUNE", None)
    r = subprocess.run(["bash", RUN_GPU, "quick", "autotune", "queue"], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "autotune_sweep: no CUDA GPU in this process" in r.stdout
    assert f"mode=cached cache={out}/autotuning" in (out / "queue" / "01_env.log").read_text()
    summary = json.loads((out / "quick_summary.json").read_text())
    assert [(x["stage"], x["rc"]) for x in summary["stages"]] == [("autotune", 0), ("queue", 0)]
