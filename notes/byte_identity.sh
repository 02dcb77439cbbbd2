#!/usr/bin/env bash
# Issue 47 item 2: the releases before and after the change are byte-identical.
# usage: notes/byte_identity.sh <code-root> <out-dir>   (run from anywhere; nice'd, one thread)
# Builds: demo; the 20k SNLI sample; Seq-Z v1 rebuilt from the committed M scores (COMMANDS.md);
# AFLite and PDD profiles (snli) with tiny models built from a config (notes/tiny_profiles.py).
# Writes <out-dir>/sha256.txt (every file, the manifest's wall-clock `seconds` fields zeroed first).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); CODE=$(cd "$1" && pwd); OUT=$2; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
SHARED=/work/shared
export PYTHONPATH=$CODE:$CODE/tests HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
export DEBIASED_NLI_CACHE=$OUT/cache
PY="nice -n 19 /work/main/.venv/bin/python"
CLI="$PY -m debiased_nli.cli"
cd "$CODE"
$PY -c "import debiased_nli,sys; assert debiased_nli.__file__.startswith('$CODE'), debiased_nli.__file__"
$CLI build demo --out "$OUT/demo" > "$OUT/demo.log" 2>&1
$CLI build snli --data-files train=$SHARED/data/snli/train_sample.parquet --out "$OUT/snli20k" > "$OUT/snli20k.log" 2>&1
R=/work/main/benchmarks/results/seqz_cpu
$CLI confidence-filter snli --data-files "train=$R/samples/shard-*.parquet" \
  --probabilities-from $R/m_scores_G.parquet --tau 0.9 --out "$OUT/rebuild_v1_kept" > "$OUT/kept.log" 2>&1
$CLI build snli --data-files train=$SHARED/data/snli/train_sample.parquet \
  --new-rows "$OUT/rebuild_v1_kept/kept.parquet" --out "$OUT/seqz_rebuild" > "$OUT/seqz.log" 2>&1
$PY "$HERE/tiny_profiles.py" "$OUT/tiny" > "$OUT/tiny.log" 2>&1
$PY "$HERE/hash_outputs.py" "$OUT"
# the rebuilt seq_z's content fingerprint (COMMANDS.md: 3573b6dc0299cacc)
$PY - "$OUT" <<'PY' | tee "$OUT/seq_z_fingerprint.txt"
import sys, datasets
from debiased_nli.data.loading import content_fingerprint
ds = datasets.load_dataset(sys.argv[1] + "/seqz_rebuild", "seq_z", split="train")
print(len(ds), content_fingerprint(ds))
PY
