#!/usr/bin/env bash
# Every GPU check and GPU benchmark in one call on a CUDA machine (issue "GPU path: correct on an H100"), and a quick
# mode that fits one 15-minute GPU slot (issue 36).
#
# Run from the repository root of a clean copy of the tracked files, with a python3 that has jax[cuda], flax,
# optax, ml_dtypes, pytest (and torch for the weight-sync benchmark); no package registry, no model asset needed:
#   bash benchmarks/run_gpu.sh quick                    # at most 480 s: the checks below, in order (one GPU slot)
#   bash benchmarks/run_gpu.sh quick train queue        # some quick stages only (each keeps its own limit)
#   bash benchmarks/run_gpu.sh plan                     # print the quick stages and their time limits (no GPU)
#   bash benchmarks/run_gpu.sh                          # all stages of the full mode
#   bash benchmarks/run_gpu.sh tests quant              # some of: tests quant matmul rollout rollout_moe
#                                                       #   kv_attention profile sync moe
#
# Quick mode (`quick`): what travels is the tracked tree plus `.whl/` (`bash benchmarks/pack_gpu_tree.sh` makes it:
# wheels of what the GPU image lacks, e.g. gin-config, reasoning_gym; pass `.whl` as a carried path). Stages, in
# order, each under `timeout` with its own limit (QUICK_PLAN below: `bash benchmarks/run_gpu.sh plan`), each
# printing its seconds; results are copied into $OUT (or runs/gpu) at the end of EACH stage, so a run cut by the
# device's time limit keeps what finished:
#   env       nvidia-smi, versions; unpack the wheels whose packages are missing into .whl/site (on PYTHONPATH);
#             import what each stage needs (benchmarks/gpu_quick.py check: requirements.json names what is missing)
#   selftest  every kernel family's self-test (fp8rl_jax.kernels.registry.FAMILIES) on the GPU -> selftest.json
#   autotune  benchmarks/autotune_sweep.py: the autotuner times the engine's decode and prefill GEMM keys (Qwen3-8B,
#             in the order the later stages use them; keys in the shipped tables are skipped) into $OUT/autotuning,
#             which every later stage reads with FP8RL_AUTOTUNE=cached (no later stage tunes); the tables to ship
#             (merged with the shipped ones) in $OUT/results/autotuning/<device_kind>/<op>.json: commit them to
#             fp8rl_jax/kernels/data/autotuning/
#   tests     every GPU test (pytest -m gpu; the files that hold GPU-marked tests), ONE pytest per file, -v
#             --tb=short -rf, GPU_TEST_JOBS (default 2) files at a time (XLA_PYTHON_CLIENT_PREALLOCATE=false), each
#             failure printed as it happens (benchmarks/pytest_live_report.py); merged into
#             benchmarks/results/gpu_tests_<device>.json (any skip is a failure here)
#   rollout   bench_rollout.py, Qwen3-8B shapes, bf16 vs fp8, b = 1 and 32, prompt 32, 32 new tokens, --floor
#             (written after every row: rollout_quick_gpu_<device>.{json,md})
#   gemm      bench_fp8_matmul.py --loop 20: the 8B GEMMs at M = 1, 32 (decode) and 4096 (prefill), bf16 vs W8A8,
#             each timing a jitted loop of 20 calls (fp8_matmul_loop_<device>.{json,md})
#   sync      bench_weight_sync.py, Qwen3-8B, in-process transport (weight_sync_quick_gpu_<device>.{json,md})
#   train     benchmarks/gpu_train_smoke.py: scripts/train.py for 5 steps, random-init tiny Qwen3 + tokenizer built
#             in code, chain_sum, FP8 rollout, every sync content-checked; fails unless every sync probe passes and
#             every loss and k3 is finite (train_smoke/train_smoke.json)
#   queue     each script in benchmarks/gpu_queue/ (sorted; *.py / *.sh, not _* or README), at most 60 s each,
#             OUT=$OUT/queue/<name>, in whatever time is left (benchmarks/gpu_queue/README.md)
# A stage may use its own limit plus what the stages before it left unused, never the limits reserved for the
# stages after it: the whole run stays within QUICK_BUDGET (480 s) whatever happens. Summary: $OUT/quick_summary.json
# and $OUT/timeline.txt; logs in $OUT/logs. Exit status: non-zero if any stage failed or was cut.
# GPU_QUICK_ALLOW_CPU=1 runs the orchestration without a GPU (for its own tests); GPU_QUEUE_DIR replaces
# benchmarks/gpu_queue and GPU_QUEUE_SCRIPT_LIMIT its 60 s per script (tests).
#
# Full mode stages:
#   tests   the GPU tests (pytest -m gpu: Pallas kernels vs the float64-numpy/ml_dtypes reference bit for bit, the
#           FP8 GEMM vs float64 at M = 1, 3, 64, 300, 4096) run ON THE GPU, then the FP8 unit and CUDA-lowering
#           tests. Fails when any GPU test is skipped, fails, or none ran.
#   quant   bench_quant.py (quantization vs device copy, all Qwen3-8B linear weights)
#   matmul  bench_fp8_matmul.py (FP8 vs bf16 GEMMs)
#   rollout bench_rollout.py at Qwen3-0.6B and 8B shapes (random weights), bf16 / fp8 / fp8 + e4m3 KV cache, prompts
#           of 32 and 512 tokens, 256 new tokens, FP8/bf16 speedups and b=1 decode against the HBM floor
#           (override the arguments with ROLLOUT_ARGS="...")
#   rollout_moe  the same at Qwen3-30B-A3B shapes (bf16 and fp8; ~57 GiB of bf16 weights, small KV budget)
#   kv_attention  bench_rollout.py at Qwen3-8B shapes, fp8 + e4m3 KV cache, 4096-token prompts, 256 new tokens, b=1
#           and 32, twice: decode attention in the Pallas kernel that reads the e4m3 cache and dequantizes inside
#           (kv_attention=auto) and over the whole dequantized cache (materialize); issue 21's ">= 1.3x at 4k contexts"
#   profile jax.profiler traces of 8B decode (bf16, fp8, fp8 + e4m3 KV): kernels per token, top kernels
#   sync    bench_weight_sync.py (export + DLPack + copy into preallocated torch tensors)
#   moe     bench_moe_grouped.py --full: one 30B-A3B MoE block's forward + backward, tiled vs ragged_dot experts
#           (XLA:GPU's ragged_dot rewrite: compiled temporaries and time)
# Results: benchmarks/results/*_gpu_<device>.{json,md}; logs and copies in $OUT (the device tool's folder) or
# runs/gpu. Exit status: non-zero if a test stage failed or a GPU test was skipped, or a benchmark failed.
set -o pipefail
cd "$(dirname "$0")/.." || exit 1

# ---------------------------------------------------------------------------------------------------- quick mode
# stage:cap_seconds, in run order; the caps sum to QUICK_BUDGET (tests/test_run_gpu.py checks it)
QUICK_PLAN="env:20 selftest:30 autotune:45 tests:115 rollout:110 gemm:35 sync:45 train:60 queue:20"
QUICK_BUDGET=480
QUEUE_SCRIPT_LIMIT=${GPU_QUEUE_SCRIPT_LIMIT:-60}

quick_cap() { local st; for st in $QUICK_PLAN; do [[ ${st%%:*} == "$1" ]] && { echo "${st##*:}"; return; }; done; echo 0; }

quick() {
  local O=${OUT:-runs/gpu} T0 status=0 selected plan_names st
  O=$(mkdir -p "$O" && cd "$O" && pwd) || return 1
  mkdir -p "$O/logs" "$O/results"
  PY=${PY:-python3}
  export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
  plan_names=$(for st in $QUICK_PLAN; do echo -n "${st%%:*} "; done)
  selected=" ${*:-$plan_names} "
  for st in $selected; do
    [[ " $plan_names " == *" $st "* ]] || { echo "run_gpu.sh quick: unknown stage '$st' (stages: $plan_names)"; return 2; }
  done
  # one persistent XLA compilation cache for every process of the run (the kernel self-tests, which each process
  # runs again, compile once); tests/conftest.py keeps a JAX_COMPILATION_CACHE_DIR it is given
  local own_cache=""
  if [[ -z ${JAX_COMPILATION_CACHE_DIR+x} ]]; then
    export JAX_COMPILATION_CACHE_DIR
    JAX_COMPILATION_CACHE_DIR=$(mktemp -d "${TMPDIR:-/tmp}/fp8rl-quick-xla-cache.XXXXXX")
    own_cache=$JAX_COMPILATION_CACHE_DIR
  fi
  T0=$(date +%s)
  : > "$O/stages.tsv"
  echo "[t=0s] quick start ($(date -u +%FT%TZ)); stages:$selected; budget ${QUICK_BUDGET}s" | tee "$O/timeline.txt"

  # limit of stage $1: its cap plus the slack earlier stages left, minus the caps of the selected later stages
  stage_limit() {
    local reserve=0 after=0 s
    for s in $plan_names; do
      [[ $after == 1 && $selected == *" $s "* ]] && reserve=$(( reserve + $(quick_cap "$s") ))
      [[ $s == "$1" ]] && after=1
    done
    echo $(( QUICK_BUDGET - ($(date +%s) - T0) - reserve ))
  }
  copy_results() {  # every file a stage wrote under benchmarks/results, into $O/results
    find benchmarks/results -type f -newer "$O/.stamp" -exec cp -p {} "$O/results/" \; 2>/dev/null
  }
  summary() {
    "$PY" - "$O" "$QUICK_BUDGET" "$(( $(date +%s) - T0 ))" <<'PY'
import json, sys
o, budget, elapsed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
stages = []
for line in open(f"{o}/stages.tsv"):
    name, secs, limit, rc, note = (line.rstrip("\n").split("\t") + [""] * 5)[:5]
    stages.append({"stage": name, "seconds": int(secs), "limit": int(limit), "rc": int(rc),
                   "timed_out": rc in ("124", "137"), "note": note})
json.dump({"budget_s": budget, "elapsed_s": elapsed, "ok": all(s["rc"] == 0 for s in stages), "stages": stages},
          open(f"{o}/quick_summary.json", "w"), indent=2)
PY
  }
  # stage_end NAME START LIMIT RC [NOTE]: print and record the stage's seconds, copy its results
  stage_end() {
    local secs=$(( $(date +%s) - $2 )) note=${5:-}
    [[ $4 == 124 || $4 == 137 ]] && note="cut by its ${3} s limit${note:+; $note}"
    [[ $4 != 0 ]] && status=1
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$secs" "$3" "$4" "$note" >> "$O/stages.tsv"
    echo "[t=$(( $(date +%s) - T0 ))s] == stage $1: ${secs} s (limit ${3} s), exit $4${note:+ ($note)}" | tee -a "$O/timeline.txt"
    copy_results
    summary
  }
  req_ok() {  # whether the env stage's import check found what stage $1 needs (true if it could not tell)
    [[ -f $O/requirements.json ]] || return 0
    "$PY" -c "import json,sys; r=json.load(open(sys.argv[1]))['stages'].get(sys.argv[2]); sys.exit(0 if r is None or r['ok'] else 1)" \
      "$O/requirements.json" "$1"
  }
  # run_stage NAME CMD...: under timeout with the stage's limit, output to the terminal and $O/logs/NAME.log
  run_stage() {
    local name=$1 lim t rc; shift
    lim=$(stage_limit "$name"); t=$(date +%s); touch "$O/.stamp"
    if (( lim < 5 )); then stage_end "$name" "$t" "$lim" 1 "no time left"; return; fi
    if ! req_ok "$name"; then stage_end "$name" "$t" "$lim" 1 "missing packages (requirements.json)"; return; fi
    echo "[t=$(( t - T0 ))s] == stage $name (limit ${lim} s): $*" | tee -a "$O/timeline.txt"
    timeout -k 10 "$lim" "$@" 2>&1 | tee "$O/logs/$name.log"
    rc=${PIPESTATUS[0]}
    stage_end "$name" "$t" "$lim" "$rc"
  }

  if [[ $selected == *" env "* ]]; then
    local t lim rc left; t=$(date +%s); lim=$(stage_limit env); touch "$O/.stamp"
    {
      nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
      "$PY" -V
      if [[ -d .whl ]]; then timeout 60 "$PY" benchmarks/gpu_quick.py site --wheels .whl --site .whl/site; fi
    } 2>&1 | tee "$O/env.txt"
    [[ -d .whl/site ]] && export PYTHONPATH="$PYTHONPATH:$PWD/.whl/site"
    left=$(( lim - ($(date +%s) - t) )); (( left < 5 )) && left=5
    timeout -k 5 "$left" "$PY" benchmarks/gpu_quick.py check --out "$O/requirements.json" 2>&1 | tee -a "$O/env.txt"
    rc=${PIPESTATUS[0]}
    stage_end env "$t" "$lim" "$rc"
    if [[ $rc != 0 && -z ${GPU_QUICK_ALLOW_CPU:-} ]]; then
      echo "run_gpu.sh quick: JAX sees no GPU or the check failed (env.txt); stopping" | tee -a "$O/timeline.txt"
      [[ -n $own_cache ]] && rm -rf "$own_cache"
      return 1
    fi
  elif [[ -d .whl/site ]]; then
    export PYTHONPATH="$PYTHONPATH:$PWD/.whl/site"
  fi
  local dev jaxv
  dev=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1])).get('gpu') or '')" "$O/requirements.json" 2>/dev/null)
  jaxv=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1])).get('jax') or '')" "$O/requirements.json" 2>/dev/null)
  local slug  # the GPU's name for result files: "NVIDIA H200" -> gpu_nvidia_h200
  slug=gpu$(echo "_$dev" | tr 'A-Z' 'a-z' | sed 's/[^a-z0-9]/_/g; s/__*/_/g; s/_$//')

  [[ $selected == *" selftest "* ]] && run_stage selftest "$PY" benchmarks/gpu_quick.py selftest --out "$O/results/selftest.json" \
    ${GPU_QUICK_ALLOW_CPU:+--allow_cpu}
  # the autotuner's sweep (issue 37 item 3): its cache serves every later stage, which only reads it (cached mode:
  # no stage after this one spends its time tuning); the tables to ship land in $O/results/autotuning
  export FP8RL_AUTOTUNE_CACHE="$O/autotuning"
  # its tuning budget: the stage's limit less ~15 s for the process's start, its self-tests and one candidate's overrun
  local tune_s; tune_s=$(( $(stage_limit autotune) - 15 )); (( tune_s < 5 )) && tune_s=5
  [[ $selected == *" autotune "* ]] && run_stage autotune "$PY" benchmarks/autotune_sweep.py --cache "$O/autotuning" \
    --ship_out "$O/results/autotuning" --budget_s "$tune_s"
  export FP8RL_AUTOTUNE=${FP8RL_AUTOTUNE:-cached}

  if [[ $selected == *" tests "* ]]; then
    local t lim files f jobs=${GPU_TEST_JOBS:-2} deadline rc
    t=$(date +%s); lim=$(stage_limit tests); deadline=$(( t + lim )); touch "$O/.stamp"
    rm -rf "$O/tests"; mkdir -p "$O/tests"; : > "$O/tests/runs.tsv"
    # the files holding GPU-marked tests; those that ran longest on the H200 first (shared/GPU.md), then any others
    files=$(grep -l "pytest\.mark\.gpu" tests/test_*.py | sort)
    files=$(for f in tests/test_fp8_gpu.py tests/test_wgmma_paths.py tests/test_fp8_attention_kernel.py $files; do
              [[ $files == *"$f"* ]] && echo "$f"; done | awk '!seen[$0]++')
    echo "[t=$(( t - T0 ))s] == stage tests (limit ${lim} s, $jobs files at a time): $(echo $files)" | tee -a "$O/timeline.txt"
    test_file() {  # one pytest for one file, its lines prefixed with the file's name as they come
      local f=$1 base lim_f t0 rc
      base=$(basename "$f" .py); t0=$(date +%s); lim_f=$(( deadline - t0 ))
      if (( lim_f < 5 )); then printf '%s\t124\t0\t%s\n' "$f" "$lim_f" >> "$O/tests/runs.tsv"; return; fi
      PYTEST_LIVE_REPORT="$O/tests/$base.jsonl" XLA_PYTHON_CLIENT_PREALLOCATE=false \
        timeout -k 5 "$lim_f" "$PY" -m pytest -v --tb=short -rf -p no:cacheprovider -p pytest_live_report -m gpu \
        --junitxml="$O/tests/$base.xml" "$f" 2>&1 | tee "$O/tests/$base.log" | sed -u "s|^|[$base] |"
      rc=${PIPESTATUS[0]}
      printf '%s\t%s\t%s\t%s\n' "$f" "$rc" "$(( $(date +%s) - t0 ))" "$lim_f" >> "$O/tests/runs.tsv"
      echo "[$base] exit $rc in $(( $(date +%s) - t0 )) s"
    }
    for f in $files; do
      while (( $(jobs -rp | wc -l) >= jobs )); do wait -n; done
      test_file "$f" &
    done
    wait
    "$PY" benchmarks/gpu_quick.py tests-report --runs "$O/tests/runs.tsv" --dir "$O/tests" --seconds $(( $(date +%s) - t )) \
      ${dev:+--device "$dev"} ${jaxv:+--jax "$jaxv"} ${GPU_QUICK_ALLOW_CPU:+--skips_pass} 2>&1 | tee "$O/logs/tests.log"
    rc=${PIPESTATUS[0]}
    stage_end tests "$t" "$lim" "$rc"
  fi

  [[ $selected == *" rollout "* ]] && run_stage rollout "$PY" benchmarks/bench_rollout.py --models 8b --engines embedded \
    --precisions bf16,fp8 --batches 1,32 --prompt_len 32 --max_tokens 32 --repeats 1 --floor --no_memory_table \
    --out "benchmarks/results/rollout_quick_$slug"
  [[ $selected == *" gemm "* ]] && run_stage gemm "$PY" benchmarks/bench_fp8_matmul.py --m 1,32,4096 --loop 20 --repeats 3 \
    --tiles "" --impls bf16,fp8_w8a8
  [[ $selected == *" sync "* ]] && run_stage sync "$PY" benchmarks/bench_weight_sync.py --sizes 8b --skip shm,dist --rounds 1 \
    --repeats 2 --out "benchmarks/results/weight_sync_quick_$slug"
  local model_tmp; model_tmp=$(mktemp -d "${TMPDIR:-/tmp}/fp8rl-quick-model.XXXXXX")  # not in $OUT: ~5 MB of weights
  [[ $selected == *" train "* ]] && run_stage train "$PY" benchmarks/gpu_train_smoke.py --out "$O/train_smoke" --steps 5 \
    --model_dir "$model_tmp/model"
  rm -rf "$model_tmp"

  if [[ $selected == *" queue "* ]]; then
    local t lim qdir=${GPU_QUEUE_DIR:-benchmarks/gpu_queue} q name left rc qrc=0 ran=0
    t=$(date +%s); lim=$(stage_limit queue); touch "$O/.stamp"
    echo "[t=$(( t - T0 ))s] == stage queue (limit ${lim} s, at most ${QUEUE_SCRIPT_LIMIT} s per script): $qdir" | tee -a "$O/timeline.txt"
    for q in $(ls "$qdir" 2>/dev/null | sort); do
      name=${q%.*}
      [[ $q == _* || $q == README* ]] && continue
      case $q in *.py) set -- "$PY" "$qdir/$q" ;; *.sh) set -- bash "$qdir/$q" ;; *) continue ;; esac
      left=$(( lim - ($(date +%s) - t) )); (( left > QUEUE_SCRIPT_LIMIT )) && left=$QUEUE_SCRIPT_LIMIT
      if (( left < 2 )); then echo "queue: no time left for $q" | tee -a "$O/timeline.txt"; qrc=1; continue; fi
      mkdir -p "$O/queue/$name"
      local t1; t1=$(date +%s)
      OUT="$O/queue/$name" timeout -k 5 "$left" "$@" 2>&1 | tee "$O/queue/$name.log" | sed -u "s|^|[queue $name] |"
      rc=${PIPESTATUS[0]}; ran=$(( ran + 1 ))
      [[ $rc != 0 ]] && qrc=1
      echo "[t=$(( $(date +%s) - T0 ))s] queue $q: exit $rc in $(( $(date +%s) - t1 )) s (limit $left s)" | tee -a "$O/timeline.txt"
    done
    stage_end queue "$t" "$lim" "$qrc" "$ran scripts"
  fi
  rm -f "$O/.stamp"
  [[ -n $own_cache ]] && rm -rf "$own_cache"
  echo "[t=$(( $(date +%s) - T0 ))s] quick done: $(awk -F'\t' '{printf "%s %ss rc=%s; ", $1, $2, $4}' "$O/stages.tsv")" \
    | tee -a "$O/timeline.txt"
  return $status
}

case ${1:-} in
  plan)
    total=0
    for st in $QUICK_PLAN; do printf '%-9s %4s s\n' "${st%%:*}" "${st##*:}"; total=$(( total + ${st##*:} )); done
    printf 'total     %4s s (budget %s s; per queue script %s s)\n' "$total" "$QUICK_BUDGET" "$QUEUE_SCRIPT_LIMIT"
    exit 0 ;;
  quick)
    shift
    quick "$@"
    exit $? ;;
esac

# ----------------------------------------------------------------------------------------------------- full mode
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}
LOG=${OUT:-runs/gpu}
mkdir -p "$LOG"
{ nvidia-smi -L; "$PY" -c "import jax, jaxlib, flax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, jax.devices())"; } \
  2>&1 | tee "$LOG/env.txt" || exit 1
"$PY" -c "import jax, sys; sys.exit(0 if any(d.platform == 'gpu' for d in jax.devices()) else 1)" \
  || { echo "run_gpu.sh: JAX sees no GPU (check JAX_PLATFORMS and the CUDA plugin)" | tee -a "$LOG/env.txt"; exit 1; }
stages=" ${*:-tests quant matmul rollout rollout_moe kv_attention profile sync moe} "
status=0
run() {  # run NAME CMD...: log to $LOG/NAME.log, remember a failure
  local name=$1; shift
  "$@" 2>&1 | tee "$LOG/$name.log"
  local rc=${PIPESTATUS[0]}
  [[ $rc -ne 0 ]] && { echo "run_gpu.sh: $name failed (exit $rc)"; status=1; }
  return 0
}
if [[ $stages == *" tests "* ]]; then
  run gpu_tests "$PY" -m pytest -q -ra -p no:cacheprovider -m gpu tests/test_fp8_gpu.py tests/test_fused_projections.py \
    tests/test_attention.py tests/test_wgmma_paths.py
  # a GPU test may skip only where no CUDA device exists, and this machine has one: any skip is a failure
  if grep -qE "[0-9]+ skipped|SKIPPED" "$LOG/gpu_tests.log"; then echo "run_gpu.sh: GPU tests were skipped"; status=1; fi
  grep -qE "[0-9]+ passed" "$LOG/gpu_tests.log" || { echo "run_gpu.sh: no GPU test ran"; status=1; }
  # the FP8 KV decode-attention kernel: its GPU tests (none may skip here), then its interpret-mode and lowering tests
  run gpu_tests_attention "$PY" -m pytest -q -ra -p no:cacheprovider -m gpu tests/test_fp8_attention_kernel.py
  if grep -qE "[0-9]+ skipped|SKIPPED" "$LOG/gpu_tests_attention.log"; then echo "run_gpu.sh: GPU tests were skipped"; status=1; fi
  grep -qE "[0-9]+ passed" "$LOG/gpu_tests_attention.log" || { echo "run_gpu.sh: no attention GPU test ran"; status=1; }
  run unit_tests_attention "$PY" -m pytest -q -ra -p no:cacheprovider -m "not gpu" tests/test_fp8_attention_kernel.py
  # the Mosaic GPU GEMM's own tests run their interpret-mode cases and, here, the kernel itself
  run mosaic_tests "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_mosaic_gemm.py tests/test_decode_fusion.py \
    tests/test_fp8_prefill_attention.py tests/test_kernel_choice.py
  run unit_tests "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_fp8_pallas.py tests/test_fp8_quant.py \
    tests/test_fp8_reference.py tests/test_fp8_dot.py tests/test_fp8_training.py tests/test_imports.py
fi
[[ $stages == *" quant "* ]] && run bench_quant "$PY" benchmarks/bench_quant.py
[[ $stages == *" matmul "* ]] && run bench_fp8_matmul "$PY" benchmarks/bench_fp8_matmul.py
[[ $stages == *" rollout "* ]] && run bench_rollout "$PY" benchmarks/bench_rollout.py --models 0.6b,8b \
  --engines embedded --precisions bf16,fp8,fp8_kv ${ROLLOUT_ARGS:---batches 1,32,128 --prompt_len 32,512 --max_tokens 256 --repeats 1 --floor}
[[ $stages == *" rollout_moe "* ]] && run bench_rollout_moe "$PY" benchmarks/bench_rollout.py --models 30b-a3b \
  --engines embedded --precisions bf16,fp8 --batches 1,32 --prompt_len 32 --max_tokens 128 --repeats 1 --floor \
  --kv_cache_memory_bytes 4294967296 --update
if [[ $stages == *" kv_attention "* ]]; then
  for impl in auto materialize; do
    run "bench_kv_attention_$impl" "$PY" benchmarks/bench_rollout.py --models 8b --engines embedded --precisions fp8_kv \
      --batches 1,32 --prompt_len 4096 --max_tokens 256 --repeats 1 --kv_cache_memory_bytes 17179869184 \
      --kv_attention "$impl" --out "benchmarks/results/rollout_kv_attention_${impl}_gpu"
  done
fi
[[ $stages == *" profile "* ]] && run bench_rollout_profile "$PY" benchmarks/bench_rollout.py --models 8b \
  --engines embedded --precisions bf16,fp8,fp8_kv --batches 1 --prompt_len 32 --max_tokens 32 --repeats 1 \
  --profile "$LOG/profile" --out benchmarks/results/rollout_profile_gpu
[[ $stages == *" sync "* ]] && run bench_weight_sync "$PY" benchmarks/bench_weight_sync.py --sizes 0.6b,8b
[[ $stages == *" moe "* ]] && run bench_moe_grouped "$PY" benchmarks/bench_moe_grouped.py --full --tokens 256,1024
cp benchmarks/results/*_gpu* "$LOG"/ 2>/dev/null
exit $status
