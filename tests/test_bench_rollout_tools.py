"""The rollout benchmark's GPU-only readers, run on synthetic input here (no GPU needed): the profile summary
(Perfetto trace of jax.profiler) and the decode HBM-floor byte count."""

from __future__ import annotations

import gzip
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

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
