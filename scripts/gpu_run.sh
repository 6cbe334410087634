#!/usr/bin/env bash
# The whole run on one GPU (docs/gpu.md, "The whole run"), after scripts/gpu_wheels.sh installed
# vLLM, Ray and megatron-core into /tmp/asyncrl-site: one JSON line per part, exit 1 if any failed.
#
#   bash scripts/gpu_run.sh [PART ...]     # on the GPU machine, repo root; PARTs: train rollout (default both)
#   bash scripts/gpu_run.sh --dry-run      # anywhere: the commands, each config composed and validated
#                                          # (`--cfg job`: nothing starts), and the weight transport found
#
# train:   `asyncrl train recipe=arith engine=vllm_gpu trainer=megatron_gpu cluster.device=cuda`, one
#          engine and one trainer rank on the one GPU (the engine's memory share engine.gpu_memory_utilization
#          = GPU_RUN_ENGINE_SHARE), 20 steps at the CPU demo's learning rate, held-out evaluation every 5
#          steps beside training. ok: greedy accuracy up >= GPU_RUN_MIN_GAIN (0.60 = 60 points), no prompt
#          lost, none trained twice; the engine-vs-trainer mismatch (k3 KL, per step) reported.
# rollout: `asyncrl bench rollout` on the GPU: the framework against raw vLLM in the same run (two
#          engines on the GPU, each GPU_RUN_ROLLOUT_SHARE of it). ok: ratio >= GPU_RUN_MIN_RATIO (0.97).
#
# One GPU for an engine and a trainer rank: Ray is told the GPU twice (cluster.num_gpus=2) and leaves
# CUDA_VISIBLE_DEVICES alone (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1), so both use device 0.
# NCCL refuses a communicator of two ranks on one device: the weights go by the shared transport
# (CUDA IPC: GPU_RUN_WEIGHT_SYNC, default trainer.weight_sync_transport=shared_memory, which on
# cuda means CUDA IPC; set it empty to pass none). Where the installed asyncrl has no such
# transport, the train part does not start (GPU_RUN_FORCE=1 starts it anyway).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
SITE=${ASYNCRL_GPU_SITE:-/tmp/asyncrl-site}
RUN_ROOT=${GPU_RUN_DIR:-/tmp/asyncrl-gpu-run}
STEPS=${GPU_RUN_STEPS:-20}
EVAL_EVERY=${GPU_RUN_EVAL_EVERY:-5}
ENGINE_SHARE=${GPU_RUN_ENGINE_SHARE:-0.3}
ROLLOUT_SHARE=${GPU_RUN_ROLLOUT_SHARE:-0.3}
MIN_GAIN=${GPU_RUN_MIN_GAIN:-0.60}
MIN_RATIO=${GPU_RUN_MIN_RATIO:-0.97}
WEIGHT_SYNC=${GPU_RUN_WEIGHT_SYNC-trainer.weight_sync_transport=shared_memory}
TRAIN_TIMEOUT=${GPU_RUN_TRAIN_TIMEOUT:-420}
ROLLOUT_TIMEOUT=${GPU_RUN_ROLLOUT_TIMEOUT:-240}

DRY=0
PARTS=()
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    train|rollout) PARTS+=("$a") ;;
    *) sed -n '2,26p' "$0" >&2; exit 2 ;;
  esac
done
[ ${#PARTS[@]} -gt 0 ] || PARTS=(train rollout)

if [ -d "$SITE" ]; then export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}; else export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}; fi
# vLLM's FlashInfer sampler compiles kernels at first use; no hub; unbuffered logs
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1
ASYNCRL=("$PYTHON" -m asyncrl.cli)

# What both parts share: the CUDA engine, eager (no CUDA-graph capture to wait for), no wandb.
COMMON=(recipe=arith engine=vllm_gpu trainer=megatron_gpu cluster.device=cuda engine.enforce_eager=true
  logging.wandb.enabled=false logging.progress_bar=false)
# The CPU demo's training settings (conf/trainer/megatron_cpu.yaml; megatron_gpu's are for large models).
TRAIN=("${COMMON[@]}" cluster.num_gpus=2 "engine.gpu_memory_utilization=$ENGINE_SHARE" trainer.lr=1e-4
  trainer.warmup_steps=0 trainer.weight_decay=0.0 "trainer.total_steps=$STEPS" trainer.checkpoint_every=0
  "eval.every_steps=$EVAL_EVERY" eval.periodic_pass_k=false "run.output_dir=$RUN_ROOT/train")
[ -z "$WEIGHT_SYNC" ] || TRAIN+=("$WEIGHT_SYNC")
ROLLOUT=("${COMMON[@]}" cluster.num_gpus=1 "engine.gpu_memory_utilization=$ROLLOUT_SHARE")

transport=$("$PYTHON" scripts/gpu_run.py transport 2>/dev/null || echo '{"same_gpu": false, "error": "asyncrl not importable"}')

if [ "$DRY" = 1 ]; then
  status=0
  echo "{\"part\": \"dry-run\", \"weight_transport\": $transport}"
  for part in "${PARTS[@]}"; do
    if [ "$part" = train ]; then cmd=("${ASYNCRL[@]}" train "${TRAIN[@]}"); else cmd=("${ASYNCRL[@]}" bench rollout "${ROLLOUT[@]}"); fi
    echo "$part: ${cmd[*]}"
    if out=$("${cmd[@]}" --cfg job 2>&1); then
      echo "$part: config valid ($(printf '%s\n' "$out" | wc -l) lines)"
    else
      echo "$part: config REFUSED:"; printf '%s\n' "$out" | tail -15; status=1
    fi
  done
  exit $status
fi

mkdir -p "$RUN_ROOT"
status=0
for part in "${PARTS[@]}"; do
  log=$RUN_ROOT/$part.log
  start=$(date +%s)
  if [ "$part" = train ]; then
    if [ -n "$WEIGHT_SYNC" ] && ! grep -q '"same_gpu": true' <<<"$transport" && [ "${GPU_RUN_FORCE:-0}" != 1 ]; then
      echo "{\"part\": \"train\", \"ok\": false, \"error\": \"no weight transport within one GPU in this asyncrl (NCCL cannot connect two ranks on one device): not started; GPU_RUN_FORCE=1 starts it\", \"weight_transport\": $transport}"
      status=1
      continue
    fi
    rm -rf "$RUN_ROOT/train"
    # SIGINT first: the run stops its actors and Ray (KeyboardInterrupt), which a kill would leave
    # holding the GPU for the next part
    timeout -s INT -k 30 "$TRAIN_TIMEOUT" "${ASYNCRL[@]}" train "${TRAIN[@]}" >"$log" 2>&1 \
      || echo "gpu_run: train exited $?" >>"$log"
    "$PYTHON" scripts/gpu_run.py train "$RUN_ROOT/train" "$MIN_GAIN" || status=1
  else
    timeout -s INT -k 30 "$ROLLOUT_TIMEOUT" "${ASYNCRL[@]}" bench rollout "${ROLLOUT[@]}" >"$log" 2>&1 \
      || echo "gpu_run: rollout exited $?" >>"$log"
    "$PYTHON" scripts/gpu_run.py rollout "$log" "$MIN_RATIO" || status=1
  fi
  echo "gpu_run: $part took $(( $(date +%s) - start )) s; log $log (last lines):" >&2
  tail -n 12 "$log" >&2
  if [ -n "${OUT:-}" ]; then tail -c 4000000 "$log" >"$OUT/$part.log"; fi  # the device tool brings $OUT back
done
exit $status
