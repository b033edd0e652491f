#!/usr/bin/env python
"""Modelled steps/hour of the paper's 8B dense config (configs/paper/exp1_dense_w8a8.gin: Qwen3-8B-Base, DAPO,
32 prompts x 16 samples, responses up to 20480 tokens, FP8 W8A8 rollout, bf16 training) on 2 nodes x 8 H100:

  sync colocated      all 16 GPUs generate, then all 16 train, then sync:  step = T_gen(16) + T_train(16) + T_sync
  async disaggregated 8 GPUs generate, 8 GPUs train, overlapped under train.max_staleness = k (1, 2):
                      steady state ~ max(T_gen(8) + T_apply, T_train(8) + T_export); k = 2 absorbs variance

scripts/plan.py has no time model (it plans memory: it compiles the steps and reads XLA's memory analysis), so the
times come from a stated roofline, and plan.py / its results are reused for what they do model:

- the run's shape (rows, prompt length, response budget, gen batches) from the gin config parsed the way plan.py
  parses it (``fp8rl_jax.trainer.cli.config_from_gin_flags``) and the model from ``scripts.plan._model_config``
  (the Qwen3-8B preset for /models/Qwen3-8B-Base); parameter count from ``hf_param_shapes``;
- memory: the trainer fits on 8 H100s (fsdp=8, 20480 tokens: benchmarks/results/plan_paper_configs_fsdp_8_config_h100.json)
  and on 16 (fsdp=16); the train state resident on each GPU in the colocated layout (its ``arguments_GiB``) is
  subtracted from the colocated rollout's KV-cache budget;
- the weight-sync payload: 9.0 GB, the measured FP8 export of the Qwen3-8B shape (docs/ROLLOUT_BRIDGE.md).

Generation (per data-parallel vLLM-style replica, one per GPU, full FP8 weights on each): response lengths are drawn
per row (Gamma, shape 2, mean --mean_response, clipped at the response budget); each replica runs continuous
batching with admission limited by its KV-cache capacity (a row is admitted when the final lengths of the rows in
flight plus its own fit: no preemption); every decode step costs max(memory, compute) with memory = (weights +
live KV bytes) / (eta_mem x 3.35 TB/s) and compute = 2 x params x live rows / (eta_fp8 x 1979 TFLOP/s); prefill is
compute-bound at the same rate. A generation batch ends when its slowest replica ends. DAPO dynamic sampling:
each step draws 1..max_num_gen_batches generation batches (probabilities --gen_batch_probs).

Training (compute-bound): FLOPs = (6 + 2 for full rematerialization) x non-embedding params x tokens + attention
(causal, 2 x layers x d_attn x S^2 forward per sequence, x4 for fwd + bwd + remat) over the 512 trained rows,
packed (only real tokens; --padded: every row padded to the batch's longest response, as a [rows, T] batch is),
at --mfu of 989 bf16 TFLOP/s dense per H100.

Sync: colocated, an NCCL all-gather of the payload to all 16 GPUs (bus bandwidth limited by one 400 Gb/s NIC per
GPU at --net_eff) plus a fixed engine reload overhead --reload_s; disaggregated, the trainer's export blocks it for
the in-node gather + the cross-node send of 1/8 of the payload per NIC (T_export), and the rollout side pays the
in-node all-gather + the reload overhead before its next batch (T_apply).

Pipeline (k >= 1): a Monte-Carlo run of the project's ``async_schedule="fixed"`` semantics: batch s starts once
version s - k is published and the previous batch is done (and after applying that version); the trainer trains
step s once batch s is done and publishes version s + 1 after T_train + T_export. Steps/hour = steps / makespan
over --mc_steps steps. Without variance k = 1 and k = 2 give the same steady state; with it, k = 2 lets the
producer run further ahead so a slow batch (3 gen batches, a long tail) stalls the trainer less.

    python benchmarks/async_planner.py                   # writes benchmarks/results/async_planner.{json,md}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import numpy as np  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
H100 = dict(hbm_tb_s=3.35, hbm_gib=80.0, bf16_tflops=989.0, fp8_tflops=1979.0, nvlink_gb_s=450.0, nic_gb_s=50.0)
PAYLOAD_GB = 9.0  # docs/ROLLOUT_BRIDGE.md "Measured sync time": Qwen3-8B shape, FP8 export payload


def load_run_shape(gin_file: str):
    """(TrainConfig, ModelConfig, source) of the paper config, parsed as scripts/plan.py parses it."""
    import plan  # scripts/plan.py

    from fp8rl_jax.trainer.cli import config_from_gin_flags

    args = argparse.Namespace(gin_file=[gin_file], gin_param=[], output_dir=None)
    cfg, error = config_from_gin_flags(args)
    if error:
        raise SystemExit(f"error: {error}")
    model_cfg, source = plan._model_config(cfg.model)
    return cfg, model_cfg, source


def param_counts(model_cfg) -> tuple[int, int]:
    """(all params, params of the matmuls: all minus the input embedding when untied)."""
    from fp8rl_jax.models.config import hf_param_shapes

    shapes = hf_param_shapes(model_cfg)
    total = sum(int(np.prod(s)) for s in shapes.values())
    emb = model_cfg.vocab_size * model_cfg.hidden_size
    matmul = total - (emb if not model_cfg.tie_word_embeddings else 0)
    return total, matmul


def kv_bytes_per_token(model_cfg, kv_dtype: str) -> int:
    bytes_per = 1 if "fp8" in str(kv_dtype) else 2
    return model_cfg.num_hidden_layers * 2 * model_cfg.num_key_value_heads * model_cfg.head_dim * bytes_per


def plan_memory(mesh_tag: str) -> dict | None:
    """exp1's planned H100 memory from the planner's results (None when the file is missing)."""
    path = os.path.join(RESULTS, f"plan_paper_configs_{mesh_tag}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        d = json.load(f)
    e = d["configs"].get("exp1_dense_w8a8")
    return None if e is None else {"file": os.path.relpath(path, ROOT), "response_len": e["response_len"],
                                   "train_total_GiB": e["train_step"]["total_GiB"],
                                   "train_args_GiB": e["train_step"]["arguments_GiB"],
                                   "train_fits": e["train_step"].get("fits"),
                                   "rollout_total_GiB": e.get("rollout_step", {}).get("total_GiB")}


class Model:
    def __init__(self, a, cfg, model_cfg):
        self.a = a
        self.rows = cfg.prompts_per_step * cfg.samples_per_prompt
        self.prompt_len = cfg.max_prompt_length
        self.budget = cfg.response_budget
        self.max_gen_batches = cfg.max_num_gen_batches if cfg.filter_groups else 1
        self.n_params, self.n_matmul = param_counts(model_cfg)
        self.layers = model_cfg.num_hidden_layers
        self.d_attn = model_cfg.num_attention_heads * model_cfg.head_dim
        self.kv_tok = kv_bytes_per_token(model_cfg, cfg.kv_cache_dtype)
        self.weights_bytes = PAYLOAD_GB * 1e9
        self.mem_bw = a.eta_mem * H100["hbm_tb_s"] * 1e12
        self.fp8_flops = a.eta_fp8 * H100["fp8_tflops"] * 1e12
        self.train_flops = a.mfu * H100["bf16_tflops"] * 1e12

    # ---- generation -------------------------------------------------------------------------------------
    def kv_capacity_tokens(self, resident_gib: float) -> float:
        usable = self.a.gpu_mem_util * H100["hbm_gib"] * 2**30 - self.weights_bytes - resident_gib * 2**30 \
            - self.a.activation_gib * 2**30
        return usable / self.kv_tok

    def lengths(self, rng, n):
        mean = self.a.mean_response
        return np.minimum(self.budget, np.maximum(1, rng.gamma(2.0, mean / 2.0, n))).astype(np.int64)

    def replica_time(self, lens: np.ndarray, cap_tokens: float) -> float:
        """One replica's continuous-batching decode of rows with response lengths ``lens`` (roofline per step)."""
        P = self.prompt_len
        waiting = list(lens)
        live = np.zeros(0, np.int64)   # remaining tokens of the rows in flight
        ctx = np.zeros(0, np.int64)    # their current context length
        final = np.zeros(0, np.int64)
        t = 0.0
        while waiting or live.size:
            admitted, reserved = [], float(final.sum())
            while waiting and (reserved + P + waiting[0] <= cap_tokens or (live.size == 0 and not admitted)):
                reserved += P + waiting[0]
                admitted.append(waiting.pop(0))
            if admitted:
                adm = np.array(admitted, np.int64)
                t += 2.0 * self.n_matmul * P * adm.size / self.fp8_flops  # prefill, compute-bound
                live = np.concatenate([live, adm])
                ctx = np.concatenate([ctx, np.full(adm.size, P, np.int64)])
                final = np.concatenate([final, adm + P])
            n = int(live.min())  # decode steps until the next row finishes
            b = live.size
            # sum over i = 0..n-1 of (W + kv_tok * (sum(ctx) + b*i)) / BW, vs compute 2*N*b per step
            kv_sum = self.kv_tok * (ctx.sum() * n + b * n * (n - 1) / 2.0)
            mem = (self.weights_bytes * n + kv_sum) / self.mem_bw
            comp = 2.0 * self.n_matmul * b * n / self.fp8_flops
            t += max(mem, comp) + self.a.decode_step_overhead_s * n
            live -= n
            ctx += n
            keep = live > 0
            live, ctx, final = live[keep], ctx[keep], final[keep]
        return t

    def gen_batch_time(self, rng, gpus: int, resident_gib: float) -> tuple[float, np.ndarray]:
        lens = self.lengths(rng, self.rows)
        cap = self.kv_capacity_tokens(resident_gib)
        per = np.array_split(rng.permutation(lens), gpus)
        return max(self.replica_time(p, cap) for p in per), lens

    # ---- training ---------------------------------------------------------------------------------------
    def train_time(self, lens: np.ndarray, gpus: int) -> float:
        P = self.prompt_len
        if self.a.padded:
            seq = np.full(lens.size, P + lens.max(), np.float64)
        else:
            seq = (P + lens).astype(np.float64)
        linear = (6.0 + (2.0 if self.a.remat else 0.0)) * self.n_matmul * seq.sum()
        attn = (4.0 if self.a.remat else 3.0) * 2.0 * self.layers * self.d_attn * (seq ** 2).sum()
        return (linear + attn) / (gpus * self.train_flops)

    # ---- sync -------------------------------------------------------------------------------------------
    def sync_colocated(self, gpus: int) -> float:
        bus = self.a.net_eff * H100["nic_gb_s"] * 1e9  # all-gather across 2 nodes: inter-node bound per GPU
        return (gpus - 1) / gpus * self.weights_bytes / bus + self.a.reload_s

    def export_disagg(self, gpus: int) -> float:
        nvl = self.a.net_eff * H100["nvlink_gb_s"] * 1e9
        nic = self.a.net_eff * H100["nic_gb_s"] * 1e9
        return (gpus - 1) / gpus * self.weights_bytes / nvl + self.weights_bytes / gpus / nic

    def apply_disagg(self, gpus: int) -> float:
        nvl = self.a.net_eff * H100["nvlink_gb_s"] * 1e9
        return (gpus - 1) / gpus * self.weights_bytes / nvl + self.a.reload_s


def sample_steps(m: Model, rng, n: int, gen_gpus: int, train_gpus: int, resident_gib: float) -> dict:
    probs = np.array(m.a.gen_batch_probs[: m.max_gen_batches], np.float64)
    probs /= probs.sum()
    T_gen, T_train, n_gb = np.zeros(n), np.zeros(n), np.zeros(n, np.int64)
    for s in range(n):
        g = 1 + rng.choice(len(probs), p=probs)
        kept = None
        for _ in range(g):
            t, lens = m.gen_batch_time(rng, gen_gpus, resident_gib)
            T_gen[s] += t
            kept = lens  # the trained rows: the kept groups' responses (modelled as the last batch's lengths)
        T_train[s] = m.train_time(kept, train_gpus)
        n_gb[s] = g
    return {"T_gen": T_gen, "T_train": T_train, "gen_batches": n_gb}


def simulate_async(T_gen, T_train, T_export, T_apply, k: int) -> dict:
    """Makespan of the fixed-schedule pipeline (batch s sampled by version max(0, s - k))."""
    n = len(T_gen)
    pub = np.zeros(n + 1)  # pub[v]: time version v is published (version 0 at t = 0)
    gen_end = np.zeros(n)
    train_end = np.zeros(n)
    trainer_wait = producer_wait = 0.0
    prev_gen_end, prev_train_end, applied = 0.0, 0.0, 0
    for s in range(n):
        v = max(0, s - k)
        ready = pub[v] if v <= s else math.inf
        start = max(prev_gen_end, ready)
        producer_wait += max(0.0, ready - prev_gen_end)
        if v != applied:
            start += T_apply
            applied = v
        gen_end[s] = start + T_gen[s]
        prev_gen_end = gen_end[s]
        tstart = max(prev_train_end, gen_end[s])
        trainer_wait += max(0.0, gen_end[s] - prev_train_end)
        train_end[s] = tstart + T_train[s] + T_export
        pub[s + 1] = train_end[s]
        prev_train_end = train_end[s]
    # steady state: drop the pipeline fill (first 5 % of steps)
    w = max(1, n // 20)
    span = train_end[-1] - train_end[w - 1]
    return {"step_s": span / (n - w), "trainer_wait_s": trainer_wait / n, "producer_wait_s": producer_wait / n}


def mean_ci(x):
    x = np.asarray(x, np.float64)
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else math.nan


def evaluate(m: Model, a, mem16, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    resident16 = (mem16 or {}).get("train_args_GiB", 0.0) if a.resident_train_state else 0.0
    colo = sample_steps(m, rng, a.mc_steps, 16, 16, resident16)
    dis = sample_steps(m, rng, a.mc_steps, 8, 8, 0.0)
    T_sync = m.sync_colocated(16)
    T_export, T_apply = m.export_disagg(8), m.apply_disagg(8)
    sync_steps = colo["T_gen"] + colo["T_train"] + T_sync
    out = {"T_sync_colocated_s": T_sync, "T_export_s": T_export, "T_apply_s": T_apply,
           "kv_capacity_tokens_per_gpu": {"colocated": m.kv_capacity_tokens(resident16),
                                          "rollout_node": m.kv_capacity_tokens(0.0)},
           "colocated": {"T_gen16_s": float(colo["T_gen"].mean()), "T_train16_s": float(colo["T_train"].mean()),
                         "step_s": float(sync_steps.mean()), "steps_per_hour": 3600.0 / float(sync_steps.mean()),
                         "gen_batches_mean": float(colo["gen_batches"].mean())},
           "disaggregated": {"T_gen8_s": float(dis["T_gen"].mean()), "T_gen8_cv": float(dis["T_gen"].std() / dis["T_gen"].mean()),
                             "T_train8_s": float(dis["T_train"].mean()),
                             "deterministic_step_s": max(float(dis["T_gen"].mean()) + T_apply,
                                                         float(dis["T_train"].mean()) + T_export)}}
    for k in a.ks:
        r = simulate_async(dis["T_gen"], dis["T_train"], T_export, T_apply, k)
        r["steps_per_hour"] = 3600.0 / r["step_s"]
        r["speedup_vs_sync"] = r["steps_per_hour"] / out["colocated"]["steps_per_hour"]
        out[f"async_k{k}"] = r
    for split in a.extra_splits:  # other rollout:train splits of the 16 GPUs (extra rows, k = max(ks))
        g, t = (int(x) for x in split.split(":"))
        ex = sample_steps(m, rng, a.mc_steps, g, t, 0.0)
        k = max(a.ks)
        r = simulate_async(ex["T_gen"], ex["T_train"], m.export_disagg(t), m.apply_disagg(g), k)
        r.update(steps_per_hour=3600.0 / r["step_s"], k=k, T_gen_s=float(ex["T_gen"].mean()),
                 T_train_s=float(ex["T_train"].mean()))
        r["speedup_vs_sync"] = r["steps_per_hour"] / out["colocated"]["steps_per_hour"]
        out[f"split_{g}_{t}"] = r
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gin_file", default=os.path.join(ROOT, "configs", "paper", "exp1_dense_w8a8.gin"))
    p.add_argument("--ks", nargs="+", type=int, default=[1, 2])
    p.add_argument("--mean_response", type=float, default=6000.0, help="mean response tokens (Gamma, shape 2)")
    p.add_argument("--gen_batch_probs", nargs="+", type=float, default=[0.6, 0.3, 0.1],
                   help="P(1, 2, 3 generation batches per step) under DAPO dynamic sampling")
    p.add_argument("--eta_mem", type=float, default=0.8, help="achieved fraction of 3.35 TB/s HBM in decode")
    p.add_argument("--eta_fp8", type=float, default=0.5, help="achieved fraction of 1979 FP8 TFLOP/s (prefill)")
    p.add_argument("--decode_step_overhead_s", type=float, default=0.0,
                   help="fixed seconds per decode step (sampling, scheduling; 0 = CUDA graphs hide it)")
    p.add_argument("--gpu_mem_util", type=float, default=0.9, help="fraction of 80 GiB the rollout engine may use")
    p.add_argument("--activation_gib", type=float, default=4.0, help="rollout activations / CUDA graphs per GPU")
    p.add_argument("--resident_train_state", action=argparse.BooleanOptionalAction, default=True,
                   help="colocated: the trainer's params + optimizer stay on the GPU during rollout (planner's "
                        "arguments_GiB at fsdp=16); --no-resident_train_state: offloaded")
    p.add_argument("--mfu", type=float, default=0.4, help="training MFU of 989 bf16 TFLOP/s")
    p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True, help="full rematerialization")
    p.add_argument("--padded", action="store_true", help="train on rows padded to the longest response")
    p.add_argument("--net_eff", type=float, default=0.8, help="achieved fraction of NVLink / NIC bandwidth")
    p.add_argument("--reload_s", type=float, default=1.0, help="fixed engine weight-reload overhead per sync")
    p.add_argument("--mc_steps", type=int, default=200, help="Monte-Carlo steps per scenario")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--extra_splits", nargs="*", default=["12:4"],
                   help="extra async rows with other rollout:train GPU splits (memory of the trainer not planned)")
    p.add_argument("--sensitivity", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", default=os.path.join(RESULTS, "async_planner"))
    a = p.parse_args(argv)

    cfg, model_cfg, source = load_run_shape(a.gin_file)
    m = Model(a, cfg, model_cfg)
    mem8, mem16 = plan_memory("fsdp_8_config_h100"), plan_memory("fsdp_16_4096_h100_xla_attention")

    def run(args):
        mm = Model(args, cfg, model_cfg)
        res = [evaluate(mm, args, mem16, s) for s in args.seeds]
        agg = {}
        for key in ["colocated"] + [f"async_k{k}" for k in args.ks] + [
                "split_" + sp.replace(":", "_") for sp in args.extra_splits]:
            agg[key] = {f: mean_ci([r[key][f] for r in res]) for f in res[0][key]}
        agg["disaggregated"] = {f: mean_ci([r["disaggregated"][f] for r in res]) for f in res[0]["disaggregated"]}
        for f in ("T_sync_colocated_s", "T_export_s", "T_apply_s"):
            agg[f] = res[0][f]
        agg["kv_capacity_tokens_per_gpu"] = res[0]["kv_capacity_tokens_per_gpu"]
        return agg, res

    main_res, per_seed = run(a)
    sens = []
    if a.sensitivity:
        variants = [("baseline (same seed and steps as the rows below)", {}),
                    ("mean response 3000", dict(mean_response=3000.0)),
                    ("mean response 10000", dict(mean_response=10000.0)),
                    ("MFU 30%", dict(mfu=0.3)), ("MFU 50%", dict(mfu=0.5)),
                    ("no dynamic sampling (1 gen batch)", dict(gen_batch_probs=[1.0, 0.0, 0.0])),
                    ("train rows padded to longest", dict(padded=True)),
                    ("reload overhead 10 s", dict(reload_s=10.0)),
                    ("decode step overhead 5 ms", dict(decode_step_overhead_s=0.005)),
                    ("colocated train state offloaded", dict(resident_train_state=False))]
        for name, over in variants:
            args = argparse.Namespace(**{**vars(a), **over, "seeds": a.seeds[:1]})
            r, _ = run(args)
            row = {"variant": name, "sync_steps_per_hour": r["colocated"]["steps_per_hour"][0],
                   "T_gen16_s": r["colocated"]["T_gen16_s"][0], "T_train16_s": r["colocated"]["T_train16_s"][0],
                   "T_gen8_s": r["disaggregated"]["T_gen8_s"][0], "T_train8_s": r["disaggregated"]["T_train8_s"][0]}
            for k in a.ks:
                row[f"k{k}_steps_per_hour"] = r[f"async_k{k}"]["steps_per_hour"][0]
                row[f"k{k}_speedup"] = r[f"async_k{k}"]["speedup_vs_sync"][0]
            sens.append(row)

    shape = {"model": source, "params": m.n_params, "matmul_params": m.n_matmul, "rows": m.rows,
             "prompt_len": m.prompt_len, "response_budget": m.budget, "max_gen_batches": m.max_gen_batches,
             "kv_bytes_per_token": m.kv_tok, "kv_cache_dtype": cfg.kv_cache_dtype,
             "rollout_precision": cfg.rollout_precision, "train_precision": cfg.train_precision}
    res = {"command": " ".join(["python", *sys.argv]), "gin_file": os.path.relpath(a.gin_file, ROOT), "shape": shape,
           "assumptions": {k: v for k, v in vars(a).items() if k not in ("out",)}, "hardware": H100,
           "payload_gb": PAYLOAD_GB, "planner_memory": {"fsdp=8": mem8, "fsdp=16": mem16},
           "result": main_res, "per_seed": per_seed, "sensitivity": sens}

    c, d = main_res["colocated"], main_res["disaggregated"]
    lines = [f"{'scenario':<42}{'T_gen s':>10}{'T_train s':>11}{'sync/export s':>15}{'step s':>10}{'steps/h':>10}"
             f"{'speedup':>9}",
             f"{'sync colocated (16 gen, 16 train)':<42}{c['T_gen16_s'][0]:>10.0f}{c['T_train16_s'][0]:>11.0f}"
             f"{main_res['T_sync_colocated_s']:>15.2f}{c['step_s'][0]:>10.0f}{c['steps_per_hour'][0]:>10.2f}{1.0:>9.2f}"]
    for k in a.ks:
        r = main_res[f"async_k{k}"]
        lines.append(f"{f'async disaggregated k={k} (8 gen | 8 train)':<42}{d['T_gen8_s'][0]:>10.0f}{d['T_train8_s'][0]:>11.0f}"
                     f"{main_res['T_export_s']:>9.2f}/{main_res['T_apply_s']:.2f}{r['step_s'][0]:>10.0f}"
                     f"{r['steps_per_hour'][0]:>10.2f}{r['speedup_vs_sync'][0]:>9.2f}")
    for sp in a.extra_splits:
        x = main_res["split_" + sp.replace(":", "_")]
        name = f"extra: async k={int(x['k'][0])} ({sp.replace(':', ' gen | ')} train)"
        lines.append(f"{name:<42}{x['T_gen_s'][0]:>10.0f}{x['T_train_s'][0]:>11.0f}{'':>15}{x['step_s'][0]:>10.0f}"
                     f"{x['steps_per_hour'][0]:>10.2f}{x['speedup_vs_sync'][0]:>9.2f}")
    print(f"{source}: {m.n_params / 1e9:.2f} B params, {m.rows} rows x ({m.prompt_len} + <= {m.budget}) tokens")
    print("\n".join(lines))
    if sens:
        print("\nsensitivity (one seed):")
        for s in sens:
            print(f"  {s['variant']:<36} sync {s['sync_steps_per_hour']:6.2f}/h  "
                  + "  ".join(f"k={k} {s[f'k{k}_steps_per_hour']:6.2f}/h (x{s[f'k{k}_speedup']:.2f})" for k in a.ks))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(res, f, indent=1, default=float)
    with open(a.out + ".md", "w") as f:
        f.write(markdown(res, a))
    print(f"wrote {a.out}.json and {a.out}.md")
    return 0


def markdown(res, a) -> str:
    r, sh = res["result"], res["shape"]
    c, d = r["colocated"], r["disaggregated"]
    pm8, pm16 = res["planner_memory"]["fsdp=8"], res["planner_memory"]["fsdp=16"]
    f = lambda x, nd=2: f"{x[0]:.{nd}f} ± {x[1]:.{nd}f}"  # noqa: E731
    out = ["# Modelled async speedup: 8B dense (exp1) on 2 nodes x 8 H100", "",
           "**A model, not a measurement.** No GPU ran; every number below follows from the assumptions listed. "
           "`scripts/plan.py` models memory only (no time model), so T_gen and T_train come from a roofline.", "",
           f"Command: `{res['command']}`", "",
           f"Config: `{res['gin_file']}` ({sh['model']}, {sh['params'] / 1e9:.2f} B params, {sh['matmul_params'] / 1e9:.2f} B "
           f"in matmuls): {sh['rows']} rows per step (32 prompts x 16), prompt {sh['prompt_len']} tokens, responses "
           f"<= {sh['response_budget']}, DAPO dynamic sampling up to {sh['max_gen_batches']} generation batches, "
           f"{sh['rollout_precision']} W8A8 rollout, {sh['train_precision']} training, KV cache `{sh['kv_cache_dtype']}` "
           f"({sh['kv_bytes_per_token']} B/token).", "",
           "Mean ± standard error over Monte-Carlo seeds " + str(a.seeds) + f" ({a.mc_steps} steps each).", "",
           "| scenario | GPUs gen / train | T_gen s | T_train s | sync s (colocated) / export + apply s | step s | steps/h | speedup |",
           "|---|---|---|---|---|---|---|---|",
           f"| sync colocated, k=0 | 16 / 16 (time-shared) | {f(c['T_gen16_s'], 0)} | {f(c['T_train16_s'], 0)} | "
           f"{r['T_sync_colocated_s']:.2f} | {f(c['step_s'], 0)} | {f(c['steps_per_hour'])} | 1.00 |"]
    for k in a.ks:
        x = r[f"async_k{k}"]
        out.append(f"| async disaggregated, k={k} | 8 / 8 | {f(d['T_gen8_s'], 0)} | {f(d['T_train8_s'], 0)} | "
                   f"{r['T_export_s']:.2f} + {r['T_apply_s']:.2f} | {f(x['step_s'], 0)} | {f(x['steps_per_hour'])} | "
                   f"{f(x['speedup_vs_sync'])} |")
    for sp in a.extra_splits:
        x = r["split_" + sp.replace(":", "_")]
        g, t = sp.split(":")
        out.append(f"| extra: async disaggregated, k={int(x['k'][0])} | {g} / {t} | {f(x['T_gen_s'], 0)} | "
                   f"{f(x['T_train_s'], 0)} | (same model, {t} trainer GPUs) | {f(x['step_s'], 0)} | "
                   f"{f(x['steps_per_hour'])} | {f(x['speedup_vs_sync'])} |")
    if a.extra_splits:
        out += ["", "Extra rows: the brief's split is 8 / 8; other splits are shown because the 8 / 8 split is "
                "generation-bound in this model. Their trainer memory was *not* planned (plan.py results exist for "
                "fsdp=8 and fsdp=16 only)."]
    kmax = max(a.ks)
    tw, pw = r[f"async_k{kmax}"]["trainer_wait_s"][0], r[f"async_k{kmax}"]["producer_wait_s"][0]
    bound = ("generation-bound: the trainer waits for batches and the producer never waits for a version, so a "
             "larger k cannot help (it only adds staleness)" if tw > 5 * max(pw, 1e-9) else
             "training-bound: the producer waits for versions; k > 1 helps only by absorbing variance"
             if pw > 5 * max(tw, 1e-9) else "balanced: both sides wait at times, which is where k = 2 helps")
    out += ["", f"Reading: the 8 / 8 pipeline is **{bound}** (k={kmax}: trainer waits {tw:.0f} s/step, producer "
            f"{pw:.0f} s/step). One generation batch cannot finish before its longest response: up to "
            f"{sh['response_budget']} sequential decode steps of at least weights / bandwidth = "
            f"{PAYLOAD_GB:.1f} GB / ({a.eta_mem:.0%} x 3.35 TB/s) = "
            f"{PAYLOAD_GB * 1e9 / (a.eta_mem * H100['hbm_tb_s'] * 1e12) * 1e3:.1f} ms each, however many GPUs "
            "generate, so taking GPUs away from generation costs more than overlapping the (shorter) training "
            "phase saves."]
    out += ["", f"Deterministic steady state (means, no variance): max(T_gen(8) + T_apply, T_train(8) + T_export) = "
            f"{d['deterministic_step_s'][0]:.0f} s/step = {3600 / d['deterministic_step_s'][0]:.2f} steps/h. "
            f"T_gen(8) coefficient of variation per step: {d['T_gen8_cv'][0]:.2f}. Mean generation batches per step: "
            f"{c['gen_batches_mean'][0]:.2f}.", "",
            "Trainer / producer waits per step in the pipeline simulation: " + "; ".join(
                f"k={k}: trainer {r[f'async_k{k}']['trainer_wait_s'][0]:.0f} s, producer {r[f'async_k{k}']['producer_wait_s'][0]:.0f} s"
                for k in a.ks) + ".", "",
            "## How the model works", "",
            "- **Generation** (`T_gen(G)`): one FP8 vLLM-style replica per GPU (full weights, 9.0 GB, data parallel), "
            f"rows split evenly. Response lengths ~ Gamma(shape 2, mean {a.mean_response:.0f}) clipped at "
            f"{sh['response_budget']}. Each replica does continuous batching; a row is admitted when the final lengths of the "
            "rows in flight plus its own fit the KV budget (no preemption). Decode step = max((weights + live KV bytes) / "
            f"({a.eta_mem:.0%} x 3.35 TB/s), 2 x params x rows / ({a.eta_fp8:.0%} x 1979 FP8 TFLOP/s)) + "
            f"{a.decode_step_overhead_s * 1e3:g} ms; prefill compute-bound at the same FP8 rate. A generation batch ends with "
            "its slowest replica. Steps draw 1/2/3 generation batches with probabilities "
            f"{a.gen_batch_probs} (DAPO dynamic sampling; `max_num_gen_batches` = 3).",
            f"- **KV budget per GPU**: {a.gpu_mem_util:.0%} x 80 GiB - 9.0 GB weights - {a.activation_gib:g} GiB activations"
            + (f" - {pm16['train_args_GiB']:.1f} GiB resident train state (colocated; planner's fsdp=16 `arguments_GiB`, "
               f"{pm16['file']})" if (a.resident_train_state and pm16) else "")
            + f": {r['kv_capacity_tokens_per_gpu']['colocated'] / 1e3:.0f} K tokens colocated, "
              f"{r['kv_capacity_tokens_per_gpu']['rollout_node'] / 1e3:.0f} K tokens on a dedicated rollout GPU.",
            f"- **Training** (`T_train(G)`): compute-bound, ({'6 + 2 (full remat)' if a.remat else '6'}) x matmul params x "
            "tokens + causal attention (2 x layers x d_attn x S^2 forward per sequence, x4 with remat) over the 512 trained "
            f"rows, {'padded to the longest response' if a.padded else 'packed (real tokens only)'}, at {a.mfu:.0%} MFU of "
            "989 bf16 TFLOP/s dense per H100. The trained rows' lengths are drawn like the generated ones.",
            f"- **Memory check (planner results)**: the 8B train step fits on 8 H100s at the config's 512 + 20480 tokens "
            + (f"({pm8['train_total_GiB']:.1f} GiB per GPU, fsdp=8, micro-batch 8, full remat, scan; {pm8['file']})"
               if pm8 else "(planner result missing)")
            + (f" and on 16 ({pm16['train_total_GiB']:.1f} GiB at {pm16['response_len']} tokens, {pm16['file']})"
               if pm16 else "") + ", so the disaggregated trainer needs no other layout.",
            f"- **Sync payload**: 9.0 GB (the measured FP8 export of the Qwen3-8B shape, docs/ROLLOUT_BRIDGE.md). The project "
            "has no GPU sync measurement yet (the CUDA IPC / NCCL columns are owed), so sync is modelled: "
            f"colocated = ring all-gather to 16 GPUs over one 400 Gb/s NIC per GPU at {a.net_eff:.0%} "
            f"(15/16 x 9.0 GB / 40 GB/s) + {a.reload_s:g} s engine reload = {r['T_sync_colocated_s']:.2f} s; disaggregated "
            f"T_export (trainer blocked) = NVLink gather on the trainer node ({a.net_eff:.0%} of 450 GB/s) + 1/8 of the "
            f"payload per NIC across nodes = {r['T_export_s']:.2f} s; T_apply (rollout side) = NVLink all-gather + "
            f"{a.reload_s:g} s reload = {r['T_apply_s']:.2f} s. (For scale, docs/ROLLOUT_BRIDGE.md cites verl users at "
            "11-13.5 s per sync for 30B-A3B with per-tensor IPC and slime at ~3 s: see the 10 s sensitivity row.)",
            "- **Pipeline** (k >= 1): the project's `async_schedule=\"fixed\"`: batch s is sampled by version max(0, s - k) "
            "and starts once that version is published and the previous batch is done (plus T_apply when the version "
            "changes); step s trains once batch s is done and publishes version s + 1 after T_train + T_export. "
            "Steps/hour = 3600 x steps / makespan (first 5% of steps dropped as pipeline fill). **How k = 2 absorbs "
            "variance**: without variance k = 1 and k = 2 give the same steady state (the slower side sets the pace); "
            "with per-step variance in T_gen (number of generation batches, long-tail lengths) a larger k lets the "
            "producer bank batches during fast steps and spend them during slow ones, so the trainer waits less.",
            "- **Not modelled**: colocated phase switches (offloading the optimizer / waking the engine: favours sync), "
            "reward computation, old-logprob / reference passes (ppo_epochs = num_minibatches = 1: none), "
            "evaluation and checkpoint steps, preemption in the engine, stragglers beyond the drawn lengths, "
            "partial rollout (`async_schedule=\"latest\"`: a batch's long tail overlapping the next batch), and "
            "NCCL / network contention between the sync and the training collectives.",
            ""]
    if res["sensitivity"]:
        ks = a.ks
        out += ["## Sensitivity (one seed)", "",
                "Each row changes one assumption; compare it with the baseline row (same Monte-Carlo seed and steps; "
                "differences of a few percent are sampling noise).", "",
                "| variant | T_gen16 s | T_train16 s | T_gen8 s | T_train8 s | sync steps/h | "
                + " | ".join(f"k={k} steps/h (speedup)" for k in ks) + " |",
                "|---|---|---|---|---|---|" + "---|" * len(ks)]
        for s in res["sensitivity"]:
            out.append(f"| {s['variant']} | {s['T_gen16_s']:.0f} | {s['T_train16_s']:.0f} | {s['T_gen8_s']:.0f} | "
                       f"{s['T_train8_s']:.0f} | {s['sync_steps_per_hour']:.2f} | "
                       + " | ".join(f"{s[f'k{k}_steps_per_hour']:.2f} ({s[f'k{k}_speedup']:.2f}x)" for k in ks) + " |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
