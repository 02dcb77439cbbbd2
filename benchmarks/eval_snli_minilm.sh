#!/usr/bin/env bash
# The real evaluation run of issue 5, sized for 2 CPU cores: all-MiniLM-L6-v2 fine-tuned on N rows of the
# 20k SNLI sample and on N rows of its z_filtered release (out/snli-release, `debiased-nli build builders/snli.yaml`),
# seeds 1-3, scored on the same seeded E-row samples of SNLI dev/test/test-hard, HANS and the Dasgupta sets.
#   bash benchmarks/eval_snli_minilm.sh [N=5000|all] [E=1000] [OUT=out/eval_runs_5k]
set -euo pipefail
N=${1:-5000}; E=${2:-1000}; OUT=${3:-out/eval_runs_5k}
MODEL=${DEBIASED_NLI_MODELS:-$HOME/.cache/debiased-nli/models}/all-minilm-l6-v2
DATA=${DEBIASED_NLI_SHARED:-../shared}/data
ROWS=(); [ "$N" = all ] || ROWS=(--max-train-rows $N)
COMMON=(--dev-files $DATA/snli/dev.parquet "${ROWS[@]}" --max-dev-rows 500 --data-seed 0 --model $MODEL
        --max-length 64 --epochs 1 --lr 5e-5 --batch-size 32 --threads 2)
SETS="snli_dev snli_test snli_test_hard hans dasgupta_compositional dasgupta_comparisons"
[ -d out/snli-release ] || debiased-nli build builders/snli.yaml --data-files train=$DATA/snli/train_sample.parquet --out out/snli-release --quiet
for seed in 1 2 3; do
  debiased-nli train snli --data-files train=$DATA/snli/train_sample.parquet "${COMMON[@]}" --seed $seed --out $OUT/base-s$seed
  debiased-nli train snli --release out/snli-release --config z_filtered "${COMMON[@]}" --seed $seed --out $OUT/zf-s$seed
done
debiased-nli evaluate --model $OUT/base-s{1,2,3} --sets $SETS --max-examples $E --sample-seed 0 --max-length 64 \
  --out $OUT/eval-base --name "SNLI sample ($N rows)"
debiased-nli evaluate --model $OUT/zf-s{1,2,3} --sets $SETS --max-examples $E --sample-seed 0 --max-length 64 \
  --out $OUT/eval-zf --name "z_filtered ($N rows)" --compare "SNLI sample ($N rows)=$OUT/eval-base/results.json"
