"""Seq-Z v2's size-quality curve (issue 45): at each tau of M's calibrated confidence, how big seq_z is, how biased
by its own audit, how big after the self-audit fixed point, and how good the samples M keeps are.

usage: python notes/seqz_v2_size_quality.py CURVE_DIR Q_RAW_DIR OUT_PREFIX
  CURVE_DIR  relo_<tau>/ (v2/recipe.yaml built with the samples M keeps at tau, in the samples' order),
             relsa_<tau>/ (v2/recipe_self_audit.yaml, the same rows), audit_seq_z_<tau>/ and audit_d0/
             (`debiased-nli audit`: a hypothesis-only model fit on the set itself)
  Q_RAW_DIR  `debiased-nli quality` over the first 5,000 parsed samples of G* (per-row fluency, ensemble label)
Writes OUT_PREFIX.json, OUT_PREFIX.md and OUT_PREFIX.png. M's calibrated confidence comes from the committed
m_scores_Gstar.parquet and calibration.json (no M needed); the thresholds are the project's choice.
"""
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from debiased_nli.methods.confidence import load_calibrator

from wilson import wilson_rounded  # notes/wilson.py (the script runs as `python notes/...`)

V2 = Path(__file__).resolve().parents[1] / "benchmarks/results/seqz_cpu/v2"
TAUS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
LABELS = ("entailment", "neutral", "contradiction")
D0_ROWS = 20_000


def raw_sample_quality(qdir: Path) -> tuple[dict, list]:
    """Per raw sample of the quality run: its label, M's calibrated confidence, the ensemble's label, fluency."""
    q = json.loads((qdir / "quality.json").read_text())
    files = [str(Path(f) if Path(f).is_absolute() else (qdir.parent / f)) for f in q["rows_files"]]
    own = [(u, lab) for f in files for u, lab in zip(*pq.read_table(f, columns=["uid", "label"]).to_pydict().values())]
    scores = pq.read_table(qdir / "scores.parquet").to_pydict()
    pos = [int(u.rsplit(":", 1)[1]) for u in scores["uid"]]  # the loader numbers rows by position in the files
    uids, labels = [own[i][0] for i in pos], np.array([own[i][1] for i in pos])
    m = pq.read_table(V2 / "m_scores_Gstar.parquet").to_pydict()
    index = {u: i for i, u in enumerate(m["uid"])}
    rows = np.array([index[u] for u in uids])
    probs = np.stack([np.asarray(m[f"m_prob_{name}"], dtype=np.float64)[rows] for name in LABELS], 1)
    conf = load_calibrator(V2 / "calibration.json")[0].apply(probs)[np.arange(len(rows)), labels]
    agree = np.array([e == LABELS[k] for e, k in zip(scores["ensemble_label"], labels)])
    fluency = np.asarray(scores["fluency"], dtype=np.float64)
    return q, [conf, agree, fluency, labels]


def stage_counts(manifest: Path) -> dict:
    """seq_z as released (after every stage, the self-audit included), the z-filter's counts, and its labels."""
    m = json.loads(manifest.read_text())
    seq = next(s for s in m["stages"] if s["stage"].startswith("seq_z"))
    labels = m["label_distribution"]["seq_z"]["train"]
    audit = [s["report"]["final_audit"] for s in m["stages"] if "final_audit" in (s.get("report") or {})]
    return {"seq_z": sum(labels.values()), "generated": seq["counts"]["kept"], "m_kept": seq["counts"]["input"],
            "labels": labels, "self_audit_hypothesis_only": audit[0]["hypothesis_only_accuracy"] if audit else None}


def main(curve: Path, qdir: Path, out: Path) -> None:
    q, (conf, agree, fluency, labels) = raw_sample_quality(qdir)
    bound = q["fluency"]["bound"]
    rows = []
    for tau in TAUS:
        keep = conf > tau
        fl = keep & np.isfinite(fluency)
        plain, sa = stage_counts(curve / f"relo_{tau}/manifest.json"), stage_counts(curve / f"relsa_{tau}/manifest.json")
        audit = json.loads((curve / f"audit_seq_z_{tau}/audit.json").read_text())
        rows.append({
            "tau": tau, "m_kept": plain["m_kept"], "seq_z": plain["seq_z"], "x_d0": round(plain["seq_z"] / D0_ROWS, 3),
            "generated_in_seq_z": plain["generated"], "seq_z_labels": plain["labels"],
            "own_audit_max_abs_z": round(audit["max_abs_z"], 1), "own_audit_hypothesis_only": audit["hypothesis_only_accuracy"],
            "own_audit_threshold": audit["z_threshold"],
            "after_self_audit": sa["seq_z"], "after_self_audit_x_d0": round(sa["seq_z"] / D0_ROWS, 3),
            "after_self_audit_hypothesis_only": sa["self_audit_hypothesis_only"],
            "raw_kept": int(keep.sum()), "raw_kept_share": round(float(keep.mean()), 4),
            "agreement": round(100 * float(agree[keep].mean()), 1), "agreement_ci": wilson_rounded(int(agree[keep].sum()), int(keep.sum()), scale=100, digits=1),
            "under_fluency_bound": round(100 * float((fluency[fl] < bound).mean()), 1),
            "under_fluency_bound_ci": wilson_rounded(int((fluency[fl] < bound).sum()), int(fl.sum()), scale=100, digits=1), "fluency_rows": int(fl.sum()),
            "neutral_share_of_kept": round(100 * float((labels[keep] == 1).mean()), 1)})
    d0 = json.loads((curve / "audit_d0/audit.json").read_text())
    fl_all = np.isfinite(fluency)
    report = {"what": __doc__.split("\n\n")[0], "raw_samples": len(conf), "fluency_bound": bound,
              "raw_all": {"agreement": round(100 * float(agree.mean()), 1),
                          "under_fluency_bound": round(100 * float((fluency[fl_all] < bound).mean()), 1)},
              "real": {"d0_cross_fitted_agreement": round(100 * q["agreement"]["d0_agreement_cross_fitted"], 1),
                       "under_fluency_bound": 5.0, "d0_own_audit_max_abs_z": round(d0["max_abs_z"], 1),
                       "d0_own_audit_hypothesis_only": d0["hypothesis_only_accuracy"]},
              "curve": rows}
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    md = ["| tau | M keeps | seq_z (x D0) | its own audit: max abs z / hyp-only acc | after the self-audit (x D0) / hyp-only | "
          "raw samples kept: label = ensemble's [95% CI] | under the fluency bound [95% CI] |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['tau']} | {r['m_kept']:,} | {r['seq_z']:,} ({r['x_d0']:.2f}x) | {r['own_audit_max_abs_z']} / "
                  f"{r['own_audit_hypothesis_only']:.3f} | {r['after_self_audit']:,} ({r['after_self_audit_x_d0']:.2f}x) / "
                  f"{r['after_self_audit_hypothesis_only']:.3f} | "
                  f"{r['agreement']}% {r['agreement_ci']} (n {r['raw_kept']:,}) | {r['under_fluency_bound']}% "
                  f"{r['under_fluency_bound_ci']} (n {r['fluency_rows']:,}) |")
    md.append(f"| all raw samples | | | | | {report['raw_all']['agreement']}% | {report['raw_all']['under_fluency_bound']}% |")
    md.append(f"| D0 (real) | | 20,000 (1.00x) | {report['real']['d0_own_audit_max_abs_z']} / "
              f"{report['real']['d0_own_audit_hypothesis_only']:.3f} | | {report['real']['d0_cross_fitted_agreement']}% "
              f"(cross-fitted) | 5.0% (by construction) |")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["x_d0"] for r in rows]
    a.plot(x, [r["own_audit_hypothesis_only"] for r in rows], "o-", label="seq_z: hypothesis-only accuracy (own audit)")
    a.plot([r["after_self_audit_x_d0"] for r in rows], [r["after_self_audit_hypothesis_only"] for r in rows], "s--",
           label="the same after the self-audit fixed point")
    for r in rows:
        a.annotate(f"tau {r['tau']}", (r["x_d0"], r["own_audit_hypothesis_only"]), fontsize=8)
    a.axhline(d0["hypothesis_only_accuracy"], ls="--", c="grey", label="D0")
    a.axvline(1.0, ls=":", c="k")
    a.set_xlabel("seq_z size (x D0)"), a.set_ylabel("hypothesis-only accuracy"), a.legend(fontsize=8)
    b.plot(x, [r["agreement"] for r in rows], "o-", label="M-kept samples: label = ensemble's (%)")
    b.plot(x, [r["under_fluency_bound"] for r in rows], "s-", label="M-kept samples: under the fluency bound (%)")
    b.axvline(1.0, ls=":", c="k")
    b.set_xlabel("seq_z size (x D0)"), b.set_ylabel("%"), b.legend(fontsize=8)
    fig.suptitle("Seq-Z v2: size against quality as M's tau moves (2 CPU cores, 20k SNLI rows)")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print("\n".join(md))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
