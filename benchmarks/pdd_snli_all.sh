#!/bin/bash
# The whole real PDD run of issue 10 on the 20k SNLI sample, in resumable stages of at most 19 minutes under the
# heavy lock; rerun it after an interruption and it continues (each stage skips or resumes what is done).
#   1. teacher: all-MiniLM-L6-v2 fine-tuned by `debiased-nli train` on 6,000 rows of the sample (1 epoch, length 64)
#   2. the masked-LM stand-in (benchmarks/pdd_mlm_standin.py)
#   3. PDD at tau' = 4.52 (the paper's 20 scaled to the sample) and at tau = 20; releases in /work/releases
#   4. the report: benchmarks/results/pdd_snli.{md,json} and pdd_snli_tau*.{md,png}
set -u
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false
RUNS=${PDD_RUN_DIR:-$HOME/runs/pdd}
LOCK=/tmp/debiased-heavy.lock
for i in $(seq 1 8); do
  [ -f "$RUNS/teacher/debiased_nli_train.json" ] && break
  echo "== teacher stage $i $(date)"
  flock $LOCK timeout 1140 debiased-nli train snli \
    --data-files train=../shared/data/snli/train_sample.parquet --dev-files ../shared/data/snli/dev.parquet \
    --model "$HOME/.cache/debiased-nli/models/all-minilm-l6-v2" --out "$RUNS/teacher" --epochs 1 --max-length 64 \
    --batch-size 16 --lr 5e-5 --max-train-rows 6000 --max-dev-rows 1000 --eval-steps 50 --threads 2
done
for i in $(seq 1 8); do
  echo "== mlm stage $i $(date)"
  flock $LOCK python benchmarks/pdd_mlm_standin.py --steps 600 --stage-minutes 18 --threads 2 && break
done
for tau in 4.52 20; do
  for i in $(seq 1 16); do
    [ -f "$RUNS/tau$tau/pdd.json" ] && break
    echo "== pdd tau $tau stage $i $(date)"
    flock $LOCK timeout -s INT 1140 python benchmarks/pdd_run.py run --tau $tau
  done
done
python benchmarks/pdd_run.py report
echo "== done $(date)"
