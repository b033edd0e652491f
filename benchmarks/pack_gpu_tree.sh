#!/usr/bin/env bash
# Prepare what travels to a GPU machine for `bash benchmarks/run_gpu.sh quick`: the wheels of what its image lacks.
#
#   bash benchmarks/pack_gpu_tree.sh          # on this machine (package registry, the project's .venv)
#
# The GPU machine (shared/GPU.md) has jax 0.11.2 with CUDA, flax, optax, torch, pytest, numpy, ml_dtypes, Python 3.12,
# no network and no package registry. This script
#   1. lists the distributions the quick stages import that the image lacks (`benchmarks/gpu_quick.py pack-list`:
#      traced imports of the trainer, the chain_sum task, the benchmarks, minus the image's packages and everything
#      they require), at the versions installed here;
#   2. downloads one wheel of each, no dependencies, binary only, for the GPU machine's Python and platform
#      (GPU_PYTHON, default 3.12; GPU_ARCH, default x86_64): pure-Python wheels where they exist, else manylinux
#      CPython wheels (tokenizers, safetensors, matplotlib, pillow, kiwisolver, pycosat), into .whl/ (git-ignored);
#      a package published only as an sdist is built into a wheel here (cellpylib: pure Python; pycosat: a C
#      extension, built with a local Python of the GPU's version: GPU_PYTHON_BIN, python3.12 on PATH or pyenv's);
#   3. prints the sizes of the wheels, of the tree that travels (tracked files and untracked ones git does not
#      ignore) and their sum, and fails if the sum exceeds 64 MiB (the device tool's limit).
# On the GPU machine run_gpu.sh unpacks into .whl/site only the wheels whose packages cannot be imported there
# (`benchmarks/gpu_quick.py site`) and puts .whl/site on PYTHONPATH. Carry the folder with the tree: the device
# tool's `carry: [".whl"]`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
GPU_PYTHON=${GPU_PYTHON:-3.12}
GPU_ARCH=${GPU_ARCH:-x86_64}
LIMIT_MIB=${LIMIT_MIB:-64}
[[ -x $PY ]] || { echo "pack_gpu_tree.sh: no Python at $PY (make setup, or set PY=)" >&2; exit 1; }

reqs=$("$PY" benchmarks/gpu_quick.py pack-list)
[[ -n $reqs ]] || { echo "pack_gpu_tree.sh: nothing to pack?" >&2; exit 1; }
echo "distributions the GPU image lacks: $(echo $reqs)"
rm -rf .whl
mkdir -p .whl
abi=cp${GPU_PYTHON/./}
err=$(mktemp); trap 'rm -f "$err"' EXIT
# sdist-only packages are built here: with a Python of the GPU machine's version when there is one (a C extension
# such as pycosat then fits it: linux_<arch> wheels, built against this machine's glibc 2.36, older than the GPU
# image's), else with $PY (pure-Python packages only)
BUILD_PY=$PY
for cand in ${GPU_PYTHON_BIN:-} $(ls -d "$HOME"/.pyenv/versions/"$GPU_PYTHON".*/bin/python 2>/dev/null) \
            $(command -v "python$GPU_PYTHON" || true); do
  if "$cand" -c "import sys, pip; sys.exit(sys.version_info[:2] != tuple(map(int, '$GPU_PYTHON'.split('.'))))" \
       2>/dev/null; then
    BUILD_PY=$cand
    break
  fi
done
plats=()
for p in manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 \
         manylinux_2_35; do
  plats+=(--platform "${p}_${GPU_ARCH}")
done
for r in $reqs; do
  # a published wheel for the GPU's Python and platform; else (an sdist-only package) a wheel built here from the
  # sdist, which must come out pure Python to be usable there
  if ! "$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest .whl --python-version "$GPU_PYTHON" \
       --implementation cp --abi "$abi" --abi abi3 --abi none "${plats[@]}" "$r" 2>"$err"; then
    "$BUILD_PY" -m pip wheel --quiet --no-deps --wheel-dir .whl "$r" 2>>"$err" \
      || { grep -v "is ignored" "$err" >&2; echo "pack_gpu_tree.sh: no wheel for $r" >&2; exit 1; }
    built=$(ls -t .whl/*.whl | head -1)
    [[ $built == *-none-any.whl || $built == *-$abi-$abi-linux_$GPU_ARCH.whl ]] \
      || { echo "pack_gpu_tree.sh: $r built as $(basename "$built"), unusable by CPython $GPU_PYTHON on $GPU_ARCH" \
                "(set GPU_PYTHON_BIN to a Python $GPU_PYTHON here)" >&2; exit 1; }
    echo "built from its sdist with $BUILD_PY: $(basename "$built")"
  fi
done
printf '%s\n' $reqs > .whl/requirements.txt
n=$(ls .whl/*.whl | wc -l)
want=$(echo $reqs | wc -w)
[[ $n == "$want" ]] || { echo "pack_gpu_tree.sh: $n wheels for $want distributions" >&2; exit 1; }

wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z -co --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "wheels: $n files, $(mib "$wheels") in .whl/"
ls -S .whl/*.whl | while read -r w; do printf '  %-70s %s\n' "$(basename "$w")" "$(mib "$(stat -c %s "$w")")"; done
echo "tree that travels (tracked + untracked not ignored): $(mib "$tree")"
echo "total: $(mib $(( wheels + tree ))) (limit ${LIMIT_MIB} MiB)"
if (( wheels + tree > LIMIT_MIB * 1048576 )); then
  echo "pack_gpu_tree.sh: over the ${LIMIT_MIB} MiB limit" >&2
  exit 1
fi
echo "ready: run 'bash benchmarks/run_gpu.sh quick' on the GPU machine with .whl carried along"
