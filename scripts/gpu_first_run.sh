#!/usr/bin/env bash
# Every CUDA path of hf_cp once, on a one-GPU machine, in about 5 minutes (issue 18):
#   tests    the gpu tests (tests/test_cuda.py): kernels, packed model, masks, block engine,
#            ChunkFlow chunks, chunked loss, in bf16 and fp32 against CPU float64 references
#   replay   scripts/gpu_profile_replay.py: profile the GPU on Qwen2.5-7B's layer, then replay
#            auto and static plans of a shared trace at world 8 with the fitted profile
#   train    hf-cp profile of Qwen2.5-0.5B (quick on CPU), then 3 optimizer steps of
#            configs/qwen2.5-0.5b-h200.yaml (random weights, bf16, no DeepSpeed) planned with it:
#            tokens/s, per-step measured vs predicted time and peak memory vs the memory model
#   deepspeed  the same 3 steps as shipped: DeepSpeed ZeRO-2 in bf16, under torchrun (NCCL, world 1)
#   throughput scripts/gpu_throughput.py (issue 30): the 0.5B config on the bundled data and on 64K-token
#            one-document steps with each attention kernel, Liger's fused loss and cp_compile, 3 steps each
#            (tokens/s, MFU, peak memory vs the memory model), then TRL DPO, TRL GRPO and FSDP2 once each;
#            table in benchmarks/gpu_h200_throughput.md. With tests, within one 10-minute call:
#              scripts/gpu_first_run.sh tests throughput
# Usage: scripts/gpu_first_run.sh [tests] [replay] [train] [deepspeed] [throughput]   (default: the first four)
# Logs and results go to $OUT (default ./gpu_run). Python packages missing on the machine can
# ride along as wheels in .whl/ (installed to /tmp/site); .whl/alt/ holds a datasets that needs an
# older pyarrow, used when the first cannot be imported. GPU_RUN_SMOKE=1 runs the same steps on
# CPU at toy sizes (to test this script without a GPU).
set -u
OUT=${OUT:-gpu_run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
PARTS=${*:-tests replay train deepspeed}
SMOKE=${GPU_RUN_SMOKE:-0}
SITE=""
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && SITE=/tmp/site
fi
export PYTHONPATH=$PWD${SITE:+:$SITE}
if ! $PY -c "import datasets" 2>"$OUT/datasets_import.txt" && ls .whl/alt/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-alt .whl/alt/*.whl
  export PYTHONPATH=$PWD:/tmp/site-alt${SITE:+:$SITE}
fi
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  $PY - <<'EOF'
import importlib
for name in ("torch", "transformers", "accelerate", "datasets", "pyarrow", "highspy", "numpy", "trl",
             "flash_attn.flash_attn_interface", "flash_attn.cute.interface", "liger_kernel", "triton"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001 (report and go on)
        print(f"{name}: not importable ({type(e).__name__}: {str(e)[:120]})")
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
} 2>&1 | tee "$OUT/env.txt"

status=0
run() {  # run NAME TIMEOUT_S CMD...: one part, its log under $OUT, its exit status kept
  local name=$1 limit=$2
  shift 2
  echo "=== $name (at most ${limit}s): $*"
  local t0=$SECONDS
  set -o pipefail
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=$?
  set +o pipefail
  echo "=== $name: exit $rc after $((SECONDS - t0))s"
  [ $rc -eq 0 ] || status=1
}

steps_table() {  # steps_table HISTORY.jsonl: per step, measured vs predicted time and peak memory
  $PY - "$1" <<'EOF'
import json, sys
print(f"{'step':>4} {'tokens':>7} {'mbs':>4} {'measured ms':>12} {'predicted ms':>13} {'wall ms':>8} "
      f"{'peak GB':>8} {'model GB':>9}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    peak = r.get("peak_memory_gb") or [float("nan")]
    pred = r.get("predicted_peak_memory_gb") or [float("nan")]
    print(f"{r['index'] + 1:>4} {r['global_tokens']:>7} {r['waves']:>4} {r['measured_ms'][0]:>12.1f} "
          f"{r['predicted_ms'][0]:>13.1f} {r['step_wall_ms']:>8.1f} {peak[0]:>8.2f} {pred[0]:>9.2f}")
EOF
}

profile_05b() {  # the 0.5B layer's profile, for the training parts' plans
  if [ "$SMOKE" = 1 ]; then
    run profile_05b 240 $PY -m hf_cp profile --model qwen2.5-0.5b --device cpu --quick --max-tokens 512 \
      --out "$OUT/profile_05b.yaml"
  else
    run profile_05b 120 $PY -m hf_cp profile --model qwen2.5-0.5b --device cuda --out "$OUT/profile_05b.yaml"
  fi
}

train_05b() {  # train_05b NAME TIMEOUT_S LAUNCHER...: 3 steps of the 0.5B config planned with $prof
  local name=$1 limit=$2 tokens=65536 cap=32768 steps=3
  shift 2
  [ "$SMOKE" = 1 ] && tokens=2048 cap=2048 steps=1 limit=$((limit * 2))  # a 0.5B step on CPU: ~45 s
  rm -rf "/tmp/hf_cp_$name"
  run "$name" "$limit" "$@" configs/qwen2.5-0.5b-h200.yaml --set training.max_steps=$steps \
    --set training.output_dir="/tmp/hf_cp_$name" --set training.cp_profile="$prof" \
    --set training.cp_tokens_per_rank_per_step=$tokens --set training.cp_max_tokens_per_rank=$cap \
    --set training.save_strategy=no --set training.cp_save_final_model=false --set training.logging_steps=1 \
    --set training.report_to=none "${extra[@]}"
  cp "/tmp/hf_cp_$name/cp_history/rank0.jsonl" "$OUT/${name}_history.jsonl" 2>/dev/null
  steps_table "$OUT/${name}_history.jsonl" 2>&1 | tee "$OUT/${name}_steps.txt"
}

for part in $PARTS; do
  case $part in
  tests)
    if [ "$SMOKE" = 1 ]; then export HF_CP_TEST_DEVICE=cpu; fi
    run cuda_tests 110 $PY -m pytest -q -m gpu tests/test_cuda.py tests/test_cuda_options.py -s -p no:cacheprovider \
      -W ignore::UserWarning
    ;;
  replay)
    if [ "$SMOKE" = 1 ]; then
      run profile_replay 170 $PY scripts/gpu_profile_replay.py --smoke --out "$OUT"
    else
      run profile_replay 170 $PY scripts/gpu_profile_replay.py --out "$OUT"
    fi
    ;;
  train)
    extra=(--set training.deepspeed=null --set training.bf16=true)
    [ "$SMOKE" = 1 ] && extra=(--set training.deepspeed=null --set training.bf16=false)
    prof=$OUT/profile_05b.yaml
    [ -f "$prof" ] || profile_05b
    train_05b train_05b 150 $PY -m hf_cp.train
    ;;
  deepspeed)
    # the config as shipped (DeepSpeed ZeRO-2, bf16) under torchrun on one GPU: NCCL world 1
    extra=()
    [ "$SMOKE" = 1 ] && extra=(--set training.deepspeed=recipes/ds-zero2-cpu.json --set training.bf16=false
      --set training.use_cpu=true)
    # PROFILE_05B: a 0.5B profile measured before (its one-layer fit is noisy on an H200)
    prof=${PROFILE_05B:-$OUT/profile_05b.yaml}
    [ -f "$prof" ] || profile_05b
    # the H200 image's TORCH_CUDA_ARCH_LIST=9.0a broke DeepSpeed's FusedAdam build: CPTrainer
    # now hands DeepSpeed "9.0" itself (setup_checks.deepspeed_arch_list)
    train_05b train_05b_zero2 240 $PY -m torch.distributed.run --nproc_per_node 1 -m hf_cp.train
    ;;
  throughput)
    # at most 420 s of runs, so that `tests throughput` fits one 10-minute call; GPU_THROUGHPUT_ARGS adds options
    if [ "$SMOKE" = 1 ]; then
      run throughput 1700 $PY scripts/gpu_throughput.py --smoke --out "$OUT" ${GPU_THROUGHPUT_ARGS:-}
    else
      run throughput 470 $PY scripts/gpu_throughput.py --out "$OUT" --budget-s 420 ${GPU_THROUGHPUT_ARGS:-}
    fi
    ;;
  *)
    echo "unknown part $part (tests, replay, train, deepspeed, throughput)" >&2
    status=2
    ;;
  esac
done
exit $status
