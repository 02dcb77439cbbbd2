#!/usr/bin/env bash
# Seq-Z v2 rebuilt from committed files, without M and without the held-out rows (issue 45 item 7):
# G*'s 182 sample shards (../samples_gstar), M's stored probabilities of every sample (m_scores_Gstar.parquet) and M's
# calibrator fitted on SNLI dev (calibration.json; COMMANDS.md says how both were made).
#   bash benchmarks/results/seqz_cpu/v2/rebuild.sh [WORK_DIR] [RELEASES_DIR] [RELEASE ...]
#   (defaults /work/runs/seqz-v2, /work/releases, and both releases: seqz-v2 seqz-v2-filtered)
# Time on 2 CPU cores, measured on a fresh machine (2026-11-29): the kept rows 25 s and seqz-v2 50 s more, about
# 1.5 min; seqz-v2-filtered about 70 min more (COMMANDS.md), nearly all of it the fluency score of each of M's
# 41,820 kept rows under SmolLM2-135M. Name only seqz-v2 to skip it.
# The kept rows' sha256 must equal kept.sha256 (else the script stops); the releases' manifests then name the
# content fingerprints that the efficacy units of benchmarks/efficacy_seqz_v2.yaml record.
set -euo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
V2=benchmarks/results/seqz_cpu/v2
SHARED=${DEBIASED_NLI_SHARED:-../shared}
WORK=${1:-/work/runs/seqz-v2}
RELEASES=${2:-/work/releases}
shift $(( $# < 2 ? $# : 2 ))
[ $# -gt 0 ] || set -- seqz-v2 seqz-v2-filtered
BUILDS=()   # release:recipe, checked before the filter runs
for w in "$@"; do
  case $w in
    seqz-v2) BUILDS+=(seqz-v2:recipe.yaml) ;;
    seqz-v2-filtered) BUILDS+=(seqz-v2-filtered:recipe_filtered.yaml) ;;
    *) echo "unknown release '$w' (seqz-v2 or seqz-v2-filtered)" >&2; exit 2 ;;
  esac
done
mkdir -p "$WORK" "$RELEASES"
if [ ! -f "$WORK/confident/kept.parquet" ]; then
  debiased-nli confidence-filter snli --data-files "train=benchmarks/results/seqz_cpu/samples_gstar/shard-*.parquet" \
    --probabilities-from $V2/m_scores_Gstar.parquet --calibrator $V2/calibration.json \
    --tau 0.95 --tau-rule min_kept --out "$WORK/confident" --quiet > "$WORK/confident.log"
fi
(cd "$WORK/confident" && sha256sum kept.parquet) | diff - $V2/kept.sha256 \
  || { echo "the kept rows differ from the committed v2's (kept.sha256)" >&2; exit 1; }
for build in "${BUILDS[@]}"; do
  name=${build%%:*} recipe=${build#*:} out=$RELEASES/$name
  # the card's quality section: `debiased-nli quality` of the config's generated rows (quality/<release>/), if measured
  quality=(); [ -f "$V2/quality/$name/quality.json" ] && quality=(--quality "$V2/quality/$name")
  # --efficacy: the card's five-seed table (the card only; the manifest the efficacy units record is unchanged)
  [ -f "$out/manifest.json" ] || debiased-nli build "$V2/$recipe" --data-files train=$SHARED/data/snli/train_sample.parquet \
    --new-rows "$WORK/confident/kept.parquet" "${quality[@]}" --efficacy benchmarks/results/efficacy_seqz_v2.json \
    --out "$out" --quiet
done
python - "$RELEASES" "${BUILDS[@]%%:*}" <<'PY'
import json, sys
for name in sys.argv[2:]:
    m = json.load(open(f"{sys.argv[1]}/{name}/manifest.json"))
    print(name, {c: sum(f["rows"] for f in v["train"]) for c, v in m["files"].items()})
PY
