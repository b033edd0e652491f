#!/usr/bin/env python
"""Qwen3-30B-A3B train step on the paper's 16 H100s: ``fsdp=16`` against ``fsdp=2,expert=8``, from compiled programs.

    .venv-cuda/bin/python benchmarks/ep_mesh_model.py --compile            # compile both meshes at 2 and 4 layers
    python benchmarks/ep_mesh_model.py                                     # the model from the committed compiles

Inputs (``--compile``, deviceless XLA:GPU for 16 abstract H100s, ``scripts/compile_h100.py``'s programs
``train_moe_fp8_fsdp16`` and ``train_moe_fp8_fsdp2_expert8``: FP8 training incl. the experts, 16 rows x (64 + 192)
tokens, one row per device): each program compiled at 2 and 4 decoder layers, its collectives read from the
optimized HLO (:func:`fp8rl_jax.gpu_dump.collective_bytes`: result bytes per device and per replica-group size) and
its memory (``memory_analysis``). A layer's share is the difference of the two compiles / 2; the rest (embedding,
lm_head, loss) is outside the layers. The full model is ``outside + 48 x layer``.

Step-time model, every assumption listed (printed with the table and written to the JSON):

* topology: 2 hosts x 8 H100s; mesh axes in order ``data, fsdp, tensor, expert`` (the last varies fastest), so an
  ``expert=8`` group is one host's 8 GPUs and an ``fsdp=2`` pair is the same GPU slot on the two hosts;
* a collective whose replica group stays inside a host runs at NVLink's 450 GB/s per GPU and direction (900 GB/s
  bidirectional, H100 SXM); one that spans the hosts at InfiniBand's 50 GB/s per GPU (8 x 400 Gb/s per host);
* bytes on the wire per device: ring / pairwise algorithms (:func:`~fp8rl_jax.gpu_dump.collective_bytes`'s
  ``wire_bytes``); a ragged all-to-all moves what is routed, not its dropless receive buffer (``e`` times the
  device's rows): counted at balanced routing, ``1/e`` of the buffer (``ragged_upper_gb`` keeps the buffer bound);
* the all-to-all bytes scale with the tokens per device (``--tokens_per_device``, default the compile's 256); the
  parameter collectives (all-gather, reduce-scatter, all-reduce) do not;
* compute: ``6 x 3.3e9`` FLOPs per token (3.3B active parameters, forward + backward) at ``--tflops`` (default 400:
  the H200's measured bf16 / W8A8 GEMM rates at M = 4096 are 288-635 TFLOP/s in the H200 run of 2026-11-27, docs/GPU.md), equal on both meshes
  (each device runs the same routed rows' FLOPs);
* no overlap (communication + compute: an upper bound) and perfect overlap (max: a lower bound).

Writes ``benchmarks/results/ep_mesh_h100/model.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
OUT_DIR = os.path.join(ROOT, "benchmarks", "results", "ep_mesh_h100")
PROGRAMS = {"fsdp=16": "train_moe_fp8_fsdp16", "fsdp=2,expert=8": "train_moe_fp8_fsdp2_expert8"}
LAYERS_30B, ACTIVE_PARAMS, COMPILE_TOKENS_PER_DEVICE = 48, 3.3e9, 256
NVLINK_GBPS, IB_GBPS = 450.0, 50.0
TOKEN_BOUND = ("all-to-all", "ragged-all-to-all")


def compile_records(path: str) -> dict:
    """Compile both programs at 2 and 4 layers (needs the CUDA plugin: ``make setup-cuda``); write ``path``."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import compile_h100

    out = {}
    for mesh, name in PROGRAMS.items():
        for layers in (2, 4):
            r = compile_h100.run_task(f"{name}@{layers}", tempfile.mkdtemp(), False)
            if not r.get("compiled"):
                raise RuntimeError(f"{name} at {layers} layers did not compile: {r.get('error')}")
            out[f"{mesh}@{layers}"] = {k: r.get(k) for k in ("compile_s", "temp_bytes", "memory", "collectives")}
            print(f"compiled {name} at {layers} layers in {r.get('compile_s')} s", flush=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return out


def _crosses_hosts(mesh: str, group: int) -> bool:
    """Whether a replica group of ``group`` devices of ``mesh`` spans the two hosts (see the module docstring)."""
    if mesh == "fsdp=2,expert=8":
        return group != 8  # expert groups are one host; fsdp pairs and all-16 groups cross
    return group > 8


def model(records: dict, tokens_per_device: int, tflops: float) -> dict:
    """The per-mesh step model (see the module docstring) from :func:`compile_records`' output."""
    rows, upper = {}, {}
    scale = tokens_per_device / COMPILE_TOKENS_PER_DEVICE
    for mesh in PROGRAMS:
        c2, c4 = records[f"{mesh}@2"], records[f"{mesh}@4"]
        wire = {"nvlink": 0.0, "ib": 0.0}
        kinds = {}
        for kind in c2["collectives"]:
            for g, v2 in c2["collectives"][kind]["by_group"].items():
                v4 = c4["collectives"][kind]["by_group"].get(g, {"wire_bytes": 0.0})
                per_layer = (v4["wire_bytes"] - v2["wire_bytes"]) / 2
                outside = v2["wire_bytes"] - 2 * per_layer
                total = outside + LAYERS_30B * per_layer
                if kind in TOKEN_BOUND:
                    total *= scale
                if kind == "ragged-all-to-all":
                    upper[mesh] = upper.get(mesh, 0.0) + total
                    total /= int(g)  # balanced routing: each device receives ~its own row count
                link = "ib" if _crosses_hosts(mesh, int(g)) else "nvlink"
                wire[link] += total
                kinds[f"{kind}[{g}]/{link}"] = round(total / 1e9, 3)
        mem = {}
        for key in ("temp", "arguments"):
            m2, m4 = c2["memory"][key], c4["memory"][key]
            mem[key] = (m2 - (m4 - m2)) + LAYERS_30B * (m4 - m2) / 2
        comm_s = wire["nvlink"] / (NVLINK_GBPS * 1e9) + wire["ib"] / (IB_GBPS * 1e9)
        compute_s = 6 * ACTIVE_PARAMS * tokens_per_device / (tflops * 1e12)
        rows[mesh] = {"wire_gb": {k: round(v / 1e9, 2) for k, v in wire.items()}, "by_kind_gb": kinds,
                      "ragged_upper_gb": round(upper.get(mesh, 0.0) / 1e9, 2),
                      "comm_s": round(comm_s, 3), "compute_s": round(compute_s, 3),
                      "step_s_no_overlap": round(comm_s + compute_s, 3),
                      "step_s_full_overlap": round(max(comm_s, compute_s), 3),
                      "memory_gib_48_layers": {k: round(v / 2**30, 1) for k, v in mem.items()}}
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile", action="store_true", help="compile the programs first (CUDA plugin)")
    p.add_argument("--tokens_per_device", type=int, default=COMPILE_TOKENS_PER_DEVICE,
                   help="tokens per device per micro-batch (the all-to-all bytes scale with it)")
    p.add_argument("--tflops", type=float, default=400.0, help="sustained TFLOP/s per GPU for the compute term")
    args = p.parse_args(argv)
    path = os.path.join(OUT_DIR, "compile_layers.json")
    records = compile_records(path) if args.compile else json.load(open(path))
    rows = model(records, args.tokens_per_device, args.tflops)
    print(f"Qwen3-30B-A3B train step (48 layers, {args.tokens_per_device} tokens per device per micro-batch), "
          f"16 H100s; NVLink {NVLINK_GBPS:.0f} GB/s, IB {IB_GBPS:.0f} GB/s per GPU, compute at {args.tflops:.0f} TFLOP/s")
    print(f"{'mesh':18} {'IB GB':>8} {'NVLink GB':>10} {'comm s':>8} {'compute s':>10} {'no overlap s':>13} "
          f"{'overlap s':>10} {'temp GiB*':>10} {'args GiB':>9}")
    for mesh, r in rows.items():
        print(f"{mesh:18} {r['wire_gb']['ib']:8.2f} {r['wire_gb']['nvlink']:10.2f} {r['comm_s']:8.3f} "
              f"{r['compute_s']:10.3f} {r['step_s_no_overlap']:13.3f} {r['step_s_full_overlap']:10.3f} "
              f"{r['memory_gib_48_layers']['temp']:10.1f} {r['memory_gib_48_layers']['arguments']:9.1f}")
    print(f"* temp: XLA's temporaries per device at the compile's {COMPILE_TOKENS_PER_DEVICE} tokens per device, no remat, "
          "48 layers by the 2/4-layer difference (not scaled with --tokens_per_device)")
    os.makedirs(OUT_DIR, exist_ok=True)
    out = {"command": "python benchmarks/ep_mesh_model.py" + (" --compile" if args.compile else "")
           + f" --tokens_per_device={args.tokens_per_device} --tflops={args.tflops}",
           "assumptions": __doc__.split("Step-time model, every assumption listed")[1].strip(),
           "rows": rows}
    with open(os.path.join(OUT_DIR, f"model_tokens{args.tokens_per_device}.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
