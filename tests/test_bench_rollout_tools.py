"""The rollout benchmark's GPU-only readers, run on synthetic input here (no GPU needed): the profile summary
(Perfetto trace of jax.profiler), the decode HBM-floor byte count, the floor's bandwidth and arithmetic; and, with a
tiny random model on the CPU, the result files written as each row ends."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_rollout import decode_bytes_per_step, profile_summary  # noqa: E402


def test_profile_summary_counts_gpu_kernels_only(tmp_path):
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0 (Stream #13)"}},
        *[{"ph": "X", "pid": 7, "tid": 1, "name": "fp8_w8a8_decode_splitk", "ts": i, "dur": 10.0} for i in range(6)],
        *[{"ph": "X", "pid": 7, "tid": 1, "name": "fusion.3", "ts": i, "dur": 2.5} for i in range(4)],
        {"ph": "X", "pid": 1, "tid": 1, "name": "$engine.py generate", "ts": 0, "dur": 1e6},  # host: not counted
    ]
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = profile_summary(str(tmp_path), steps=2)
    assert s["source"] == "gpu" and s["kernels"] == 10 and s["kernels_per_token"] == 5
    assert [t["name"] for t in s["top"]] == ["fp8_w8a8_decode_splitk", "fusion.3"]
    np.testing.assert_allclose(s["kernel_time_ms"], (6 * 10 + 4 * 2.5) / 1e3)
    np.testing.assert_allclose(s["top"][0]["share"], 60 / 70)


class _T:
    def __init__(self, shape, itemsize):
        self.shape, self.size = shape, int(np.prod(shape))
        self.dtype = np.dtype({1: np.uint8, 2: np.float16, 4: np.float32}[itemsize])


def test_decode_bytes_reads_active_experts_and_one_embedding_row_per_sequence():
    class Cfg:
        tie_word_embeddings, num_experts, num_experts_per_tok = False, 16, 2

    class W:
        tensors = {"model.embed_tokens.weight": _T((1000, 64), 2), "lm_head.weight": _T((1000, 64), 2),
                   "model.layers.0.self_attn.q_proj.weight": _T((64, 64), 1),
                   **{f"model.layers.0.mlp.experts.{j}.up_proj.weight": _T((32, 64), 1) for j in range(16)}}

    # batch 3: embedding 3 rows of 64 bf16; lm_head whole; q_proj whole; experts: min(1, 3*2/16) of 16 x 2048 B
    want = 3 * 64 * 2 + 1000 * 64 * 2 + 64 * 64 + (6 / 16) * 16 * 32 * 64 + 3 * 10.0 * 100
    np.testing.assert_allclose(decode_bytes_per_step(Cfg, W, 3, 10.0, 100), want)


def test_datasheet_bandwidth_by_device_kind():
    from bench_rollout import datasheet_bandwidth_GBps

    assert datasheet_bandwidth_GBps("NVIDIA H200") == 4800.0
    assert datasheet_bandwidth_GBps("NVIDIA H100 80GB HBM3") == 3350.0  # SXM
    assert datasheet_bandwidth_GBps("NVIDIA H100 PCIe") == 2000.0
    assert datasheet_bandwidth_GBps("NVIDIA H100 NVL") == 3900.0
    assert datasheet_bandwidth_GBps("cpu") is None and datasheet_bandwidth_GBps("NVIDIA A100-SXM4-80GB") is None


def test_floor_bandwidth_prefers_the_datasheet_and_names_its_source():
    from bench_rollout import floor_bandwidth

    bw, src = floor_bandwidth("NVIDIA H200", 4100.0)  # a measured read below the datasheet: the datasheet
    assert bw == 4800.0 and src.startswith("datasheet") and "NVIDIA H200" in src
    bw, src = floor_bandwidth("NVIDIA H200", 5200.0)  # above what HBM gives: used (so nothing exceeds 100%), flagged
    assert bw == 5200.0 and "above" in src and "4800" in src
    bw, src = floor_bandwidth("cpu", 9.5)  # no datasheet: the measurement
    assert bw == 9.5 and src.startswith("measured read")
    with pytest.raises(ValueError, match="no HBM bandwidth"):
        floor_bandwidth("cpu", None)


def test_hbm_floor_arithmetic_and_cap():
    from bench_rollout import hbm_floor

    # 16.4 GB per step at 4800 GB/s: a floor of 16.4e9 / 4.8e12 s = 3.4167 ms; measured 4.70 ms per token
    f = hbm_floor(16.4e9, 4.70e-3, 4800.0)
    np.testing.assert_allclose(f["floor_ms_per_token"], 16.4e9 / 4.8e12 * 1e3)
    np.testing.assert_allclose(f["pct_of_hbm_floor"], 100 * (16.4e9 / 4.8e12) / 4.70e-3)
    assert f["pct_of_hbm_floor"] == f["pct_of_hbm_floor_raw"] and not f["above_floor"]
    # faster than the floor is impossible: capped at 100, raw kept, flagged (the old copy-bandwidth floor said 161%)
    f = hbm_floor(16.4e9, 0.5 * 16.4e9 / 4.8e12, 4800.0)
    assert f["pct_of_hbm_floor"] == 100.0 and f["above_floor"]
    np.testing.assert_allclose(f["pct_of_hbm_floor_raw"], 200.0)
    with pytest.raises(ValueError):
        hbm_floor(1e9, 0.0, 4800.0)
    with pytest.raises(ValueError):
        hbm_floor(1e9, 1e-3, 0.0)


def test_read_bandwidth_is_positive_on_the_cpu():
    from bench_rollout import read_bandwidth_GBps

    assert read_bandwidth_GBps(1 << 22, repeats=2) > 0


def test_report_splits_the_first_call_and_holds_issue_37s_goals(tmp_path):
    """The report's first-call table: each FP8 row's compile is its first call less the self-tests and the tuning
    it paid, over bf16's at the same prompt and batch; the speedup table names issue 37's goal per batch."""
    import argparse

    from bench_rollout import write_report

    def row(b, tps, first, selftest=0.0, autotune=0.0):
        return {"prompt_len": 32, "batch": b, "seconds": 1.0, "tokens_per_s": tps, "first_call_s": first,
                "first_call_selftest_s": selftest, "first_call_autotune_s": autotune,
                "first_call_compile_s": first - selftest - autotune}

    def cell(precision, rows):
        return {"engine": "embedded", "model": "8b", "precision": precision, "weights_served": precision,
                "peak_memory_MiB": 1.0, "prompt_tokens_mean": 32.0, "rows": rows}

    cells = [cell("bf16", [row(1, 200.0, 11.0), row(32, 5000.0, 19.0)]),
             cell("fp8", [row(1, 340.0, 30.0, selftest=4.0, autotune=9.5), row(32, 6000.0, 26.0, autotune=1.0)])]
    args = argparse.Namespace(batches="1,32", max_tokens=32, repeats=1)
    text = write_report(str(tmp_path / "r"), ("gpu", "NVIDIA H200"), args, "cmd", cells, [], [])
    d = json.loads((tmp_path / "r.json").read_text())
    first = {x["batch"]: x for x in d["fp8_first_call"]}
    assert first[1]["s"] == 16.5 and first[1]["bf16_s"] == 11.0 and first[32]["s"] == 25.0
    np.testing.assert_allclose([first[1]["ratio"], first[32]["ratio"]], [16.5 / 11.0, 25.0 / 19.0], rtol=1e-12)
    assert "| embedded | 8b | fp8 | 32 | 1 | 30.0 | 4.0, 9.5 | 16.5 (11.0) | 1.50x |" in text
    sp = d["fp8_speedups"][0]
    assert sp["goal"] == {"32:1": 1.6, "32:32": 1.3}
    np.testing.assert_allclose([sp["speedup"]["32:1"], sp["speedup"]["32:32"]], [1.7, 1.2], rtol=1e-12)
    assert "32:1: 1.70x (>= 1.6x), 32:32: 1.20x (>= 1.3x)" in text


def test_each_row_is_written_as_it_ends_and_survives_a_kill(tmp_path):
    """A tiny random Qwen3, two cells (bf16, fp8), --floor: the result files appear while the run goes on (after the
    first cell's rows, before the second cell is done), hold valid JSON with the floor figures, and stay when the
    run is killed there."""
    out = tmp_path / "rollout_tiny"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "benchmarks", "bench_rollout.py"), "--models", "tiny",
                             "--engines", "embedded", "--precisions", "bf16,fp8", "--batches", "1,2",
                             "--max_tokens", "3", "--repeats", "1", "--floor", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    seen = None
    deadline = time.time() + 600
    try:
        while time.time() < deadline and proc.poll() is None:
            if os.path.exists(str(out) + ".json"):
                with open(str(out) + ".json") as f:
                    d = json.load(f)  # never half a file: written through a rename
                cells = {c["precision"]: c for c in d["cells"]}
                if not d["complete"] and "bf16" in cells and len(cells["bf16"]["rows"]) == 2:
                    seen = d  # the first cell complete, the run still going
                    break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # this test's own process group (bench_rollout and its cell child)
        log = proc.communicate()[0]
    assert seen is not None, f"no partial result file seen while the run went on:\n{log[-3000:]}"
    with open(str(out) + ".json") as f:
        after = json.load(f)
    assert after["complete"] is False and any(c["precision"] == "bf16" for c in after["cells"])
    assert "Partial" in (tmp_path / "rollout_tiny.md").read_text()
    cell = next(c for c in seen["cells"] if c["precision"] == "bf16")
    assert [r["batch"] for r in cell["rows"]] == [1, 2]
    row = cell["rows"][0]
    np.testing.assert_allclose(row["floor_ms_per_token"], row["bytes_per_step_MB"] * 1e6 / (row["floor_GBps"] * 1e9)
                               * 1e3, rtol=1e-9)
    np.testing.assert_allclose(row["pct_of_hbm_floor_raw"], 100 * row["floor_ms_per_token"]
                               / row["decode_ms_per_token"], rtol=1e-9)
    assert 0 < row["pct_of_hbm_floor"] <= 100 and row["floor_bandwidth_source"].startswith("measured read")
    assert row["prefill_timing"] == "same program, stopped at its first token"


def test_compile_stages_reads_xla_timer_lines():
    """benchmarks/compile_stages.py's reader of XLA:GPU's compile timers, on lines as jax 0.10.2's XLA logs them
    with TF_CPP_VMODULE=gpu_compiler=1 (the first two copied from a run on this machine, the others in their format:
    a second module and a time over a minute, which XLA writes in minutes): the exact microseconds read, modules
    summed, the cumulative figure and other timers ignored, None when a timer is absent."""
    from compile_stages import xla_timers

    log = "\n".join([
        "I1129 02:32:26.704453   18126 gpu_compiler.cc:2152] GpuCompiler::RunHloPasses for jit__generate time: "
        "1.52 s (1522342 us) (cumulative: 1.52 s, max: 1.52 s, #called: 1)",
        "I1129 02:32:26.933387   18151 nvptx_compiler.cc:520] NVPTXCompiler::CompileTargetBinary - CompileToPtx for "
        "jit__generate time: 30.4 ms (30418 us) (cumulative: 30.4 ms, max: 30.4 ms, #called: 1)",
        "I1129 02:32:31.001000   18126 gpu_compiler.cc:2600] GpuCompiler::RunBackend for jit__generate time: "
        "5.21 s (5213490 us) (cumulative: 5.21 s, max: 5.21 s, #called: 1)",
        "I1129 02:32:31.101000   18126 gpu_compiler.cc:2152] GpuCompiler::RunHloPasses for jit_other time: "
        "906 ms (905775 us) (cumulative: 2.43 s, max: 1.52 s, #called: 2)",
        "I1129 02:34:01.101000   18126 gpu_compiler.cc:2600] GpuCompiler::RunBackend for jit_other time: "
        "1.05 min (63000000 us) (cumulative: 1.14 min, max: 1.05 min, #called: 2)",
    ])
    assert xla_timers(log) == {"hlo_passes_s": 2.43, "backend_s": 68.21}
    assert xla_timers("no timers here") == {"hlo_passes_s": None, "backend_s": None}


def test_compile_stages_programs_add_the_bf16_moe_baseline(capsys):
    """compile_stages.py measures the compile lane's programs and, as the MoE FP8 programs' baseline, a bf16 MoE engine
    of the same widths (the lane has none); an unknown name is refused before anything compiles."""
    from compile_stages import main, programs

    progs = programs()
    for b in (1, 128):
        bf16, fp8 = progs[f"generate_moe_bf16_b{b}"], progs[f"generate_moe_fp8_b{b}"]
        assert (bf16.kind, bf16.model, bf16.precision, bf16.batch) == ("generate", "30b-a3b", "bf16", b)
        assert (fp8.model, fp8.precision, fp8.kv_cache, fp8.batch) == ("30b-a3b", "fp8", "auto", b)
    with pytest.raises(SystemExit) as e:
        main(["--programs", "generate_fp8_b1", "generate_bogus_b1"])
    assert e.value.code == 2 and "unknown program(s) generate_bogus_b1" in capsys.readouterr().err
