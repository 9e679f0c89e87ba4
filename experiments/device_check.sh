#!/usr/bin/env bash
# The prepared check for a GPU machine: on a random ~0.5 B-parameter Qwen2 (built here, nothing downloaded),
# (1) the vLLM engine against vLLM's own offline LLM.generate on the same prompts, tokens/s, and multi-turn
# episodes; (2) one training step of `rail train` with the vLLM engine, its time split. Results land in $OUT.
# Needs vLLM for CUDA: pip install -e ".[gpu]" (vLLM brings its own torch).
# Run: bash experiments/device_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/rail-device-check}}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt" || true

# ~0.5 B parameters: 28 layers of hidden 1024 (16 heads of 64, 4 KV heads), MLP 5120, BPE vocabulary 2048
MODEL="$OUT/qwen-0.5b"
[ -f "$MODEL/config.json" ] || "$PY" experiments/make_tiny_model.py "$MODEL" --hidden 1024 --layers 28 \
    --heads 16 --kv-heads 4 --intermediate 5120 --vocab 2048 | tee "$OUT/model.json"

# (1) engine against LLM.generate, bf16 as a GPU user runs it
timeout 600 "$PY" experiments/bench_vllm.py --model "$MODEL" --dtype bfloat16 --batch 64 256 --tokens 64 --turns 4 \
    --kv-cache-mb 16384 | tee "$OUT/bench_vllm.jsonl"

# (2) one training step with the vLLM engine (no warm start: a random model; the learned controller)
rm -rf "$OUT/train"
timeout 900 "$PY" -m rail.cli train --preset default --model "$MODEL" --out "$OUT/train" --tracking-uri "" \
    --no-progress --set rollout.tool_format='hermes' --set rollout.engine='vllm' --set warmstart.enabled=false \
    --set learner.old_logprobs='recompute' --set rollout.vllm_kv_cache_mb=16384 --set run.steps=1 \
    --set eval.tasks_per_level=4 --set learner.minibatch_size=16 | tee "$OUT/train.txt"
"$PY" - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
step = [json.loads(x) for x in open(f"{out}/train/metrics.jsonl") if '"time/generate_s"' in x][0]
summary = json.load(open(f"{out}/train/summary.json"))
print(json.dumps({"train_step_seconds": {k: step[f"time/{k}_s"] for k in ("generate", "score", "controller", "update")},
                  "tis_ratio_mean": step.get("tis/ratio_mean"), "tis_logprob_diff_max": step.get("tis/logprob_diff_max"),
                  "wall_seconds": summary["wall_seconds"]}))
EOF
