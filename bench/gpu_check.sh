#!/usr/bin/env bash
# The GPU check of the Search-R1 recipe (docs/guides/gpu.md), for a machine with one CUDA GPU, at most ~12 minutes:
#   1. the demo (`make demo`'s pipeline: retriever, gateway with the local engine, SFT, GRPO + SIS) with the trainer
#      and the local engine on CUDA in bf16, its summary and record;
#   2. the trainer's update at Qwen2.5-0.5B and -3B shapes (bench/gpu_check.py): tokens/s, peak memory, MFU.
# Records go to bench/results/ (or $SISRL_BENCH_RESULTS); with $OUT set (the device tool), copies land there too.
#   bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { make install; }
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'bench/gpu_check.sh: no CUDA device')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
work=${WORK:-runs/gpu_check}
mkdir -p "$work"
# 1. the demo on CUDA: bf16 engine (the gateway's dtype auto) and bf16 autocast in the trainer
timeout 420 "$PY" -m sisrl.trainer.demo --workdir "$work/demo" --set device=cuda --set model.autocast_bf16=true \
    2>&1 | tail -n 40 || echo "gpu_check: the demo did not finish in 7 minutes (see $work/demo/logs)"
# 2. the update at the recipe's shapes (each shape ~1-2 minutes on an H100)
timeout 300 "$PY" bench/gpu_check.py --shapes 0.5b 3b || echo "gpu_check: the update check did not finish"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT" && cp -r "$work/demo/summary.json" "$OUT/" 2>/dev/null || true
  find bench/results -newer "$work" -name '*.json' -exec cp --parents {} "$OUT" \; || true
fi
