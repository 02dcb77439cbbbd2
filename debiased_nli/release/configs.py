"""A release's configs: what each is, which columns its data keeps."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ..data.loading import PROVENANCE_COLUMNS

CONFIG_DESCRIPTIONS = {
    "original": "the input D0, unchanged (for comparison)",
    "z_filtered": "Z(D0): the original rows z-filtered (Wu et al. 2022, Algorithm 1)",
    "z_aug": "Z-Aug = Z(D_G | D0): the original rows plus the new rows kept by z-filtering conditioned on them",
    "par_z": "Par-Z = Z(D0) ∪ Z(D_G): the z-filtered original rows plus the separately z-filtered new rows",
    "seq_z": "Seq-Z = Z(D_G | Z(D0)): the z-filtered original rows plus the new rows kept by z-filtering "
             "conditioned on them",
    "aflite": "AFLite (Le Bras et al. 2020): the original rows that an ensemble of linear models on embeddings "
              "does not predict too easily",
    "ibadr": "IBADR (Wang et al. 2023): the original rows plus the pseudo samples of an iterative bias-aware generator",
    "pdd": "PDD (Guo et al. 2023): the original rows with masked-LM perturbations added or swapped in until every "
           "biased feature's z is under the threshold",
}


# provenance of new rows that a config's data keeps when its train split has them (PDD's perturbed rows)
DATA_EXTRA_COLUMNS = ("source_uid", "teacher_confidence")


CANONICAL = ("premise", "hypothesis", "label") + PROVENANCE_COLUMNS


ROWS_PER_SHARD = 500_000


@dataclasses.dataclass
class ConfigData:
    """One config of a release: its splits, the rows its stage dropped, and a description."""

    name: str
    splits: dict[str, Any]
    # the rows its stage dropped, in the columns written to rejected/<config>/ (the canonical ones, the reason,
    # the step's own: see release.step_registry.Rejects, the one place that shapes them)
    rejected: Any = None
    description: str = ""
    stages: list[dict] = dataclasses.field(default_factory=list)
    card_section: str | None = None  # markdown a filter step adds to the card (e.g. AFLite's audit)
    # the train split's features as parts (matrix, labels, rows or None) of matrices sharing one
    # vocabulary, for its z-statistics; without them they are read from the split's feat_* columns
    features: list | None = None
    # a filter step's decision record (release.decisions.Record): written to decisions/<config>/
    decisions: Any = None


def canonical_only(ds, extra: Sequence[str] = ()):
    keep = [c for c in list(CANONICAL) + list(extra) if c in ds.column_names]
    return ds.select_columns(keep)


def data_extra_columns(c: "ConfigData") -> list[str]:
    train = c.splits.get("train")
    return [col for col in DATA_EXTRA_COLUMNS if train is not None and col in train.column_names]
