#!/bin/bash
# One AFLite round (benchmarks/bench_aflite.py's defaults: 500k rows, m = 64, t = 50k) on a machine with a GPU:
#   1. ours on the GPU, alone;
#   2. then at the same time, each in its own process on one CPU thread: ours on the CPU and the 64
#      scikit-learn fits in 4 units of 16 (the machine's cores are many; the units do not share a core);
#   3. two reports against the same scikit-learn fits: <stem>.md (ours on the GPU) and <stem>_cpu.md (ours
#      on one CPU thread of the same machine).
# Usage: bash benchmarks/bench_aflite_gpu.sh EMBEDDINGS.npz OUT_DIR [STEM]
#   EMBEDDINGS.npz: the real run's embeddings as X, y, for a machine without this project's cache and the
#   encoder; written where the AFLite SNLI run's cache is (27.8 MB) with
#     python -c "import numpy as np; from benchmarks.bench_aflite import real_embeddings as r; \
#       from debiased_nli.methods.embeddings import OFFLINE_ENCODER as e; X, y = r(e); np.savez('emb.npz', X=X, y=y)"
# Measured on an H200 (benchmarks/results/aflite_bench_gpu.md, aflite_bench_gpu_cpu.md) with
#   bash benchmarks/bench_aflite_gpu.sh .aflite_gpu/emb.npz "$OUT/res"
set -euo pipefail
EMB=${1:?usage: bench_aflite_gpu.sh EMBEDDINGS.npz OUT_DIR [STEM]}
OUT=${2:?usage: bench_aflite_gpu.sh EMBEDDINGS.npz OUT_DIR [STEM]}
STEM=${3:-aflite_bench_gpu}
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
# the checkout's package, where it is not installed (a copy of the working tree on a lent machine)
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
W=$(mktemp -d)
G="--embeddings $EMB --out $OUT --work $W/gpu --device cuda --stem $STEM"
C="--embeddings $EMB --out $OUT --work $W/cpu --stem ${STEM}_cpu"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 benchmarks/bench_aflite.py $G --units ours
pids=()
python3 benchmarks/bench_aflite.py $C --units ours & pids+=($!)
for u in sklearn-0-16 sklearn-16-32 sklearn-32-48 sklearn-48-64; do
  python3 benchmarks/bench_aflite.py $G --units $u & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
cp "$W"/gpu/sklearn-* "$W"/cpu/
python3 benchmarks/bench_aflite.py $G --units report
python3 benchmarks/bench_aflite.py $C --units report
cp -r "$W" "$OUT/work"
