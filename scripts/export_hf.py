#!/usr/bin/env python
"""Export a training run's checkpoint as an HF model directory (safetensors, bf16 or FP8 blockwise).

    python scripts/export_hf.py --run_dir=runs/quickstart --output=exported/bf16
    python scripts/export_hf.py --run_dir=runs/quickstart --format=fp8 --step=20 --output=exported/fp8

The FP8 directory carries ``quantization_config`` (``quant_method: fp8``, ``fmt: e4m3``, ``activation_scheme:
dynamic``, ``weight_block_size: [128, 128]``, ``modules_to_not_convert`` / ``ignored_layers``) and
``weight_scale_inv`` tensors, the layout vLLM and transformers load as a blockwise FP8 checkpoint. Linears that one
of them cannot load as 128x128 blockwise FP8 (e.g. all of SmolLM2-135M's: hidden size 576, k_proj 192 rows) are
written in bf16, listed under those two keys, and named in one printed line. Exit status 2 with a one-line message
for a missing run or checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    """Parse flags and export the run's checkpoint as an HF directory; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run_dir", required=True, help="run directory (with checkpoints/) or checkpoint root")
    parser.add_argument("--output", required=True, help="HF directory to write")
    parser.add_argument("--format", default="bf16", choices=["bf16", "float32", "fp8"], help="weight format")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--model", default=None, help="model source of the run (default: recorded in the checkpoint)")
    args = parser.parse_args(argv)

    from fp8rl_jax.trainer.cli import fail
    from fp8rl_jax.trainer.hf_export import export_checkpoint_to_hf

    try:
        path = export_checkpoint_to_hf(args.run_dir, args.output, fmt=args.format, step=args.step, model=args.model,
                                      log=print)
    except (FileNotFoundError, ValueError) as e:
        return fail(str(e))
    print(f"wrote {args.format} HF directory {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
