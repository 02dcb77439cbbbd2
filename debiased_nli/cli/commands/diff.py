"""``debiased-nli diff``: what changed between two releases, as a table for a release note."""
from __future__ import annotations

import sys

from ._common import DefaultsHelpFormatter, NON_NEGATIVE_INT


def register(sub) -> None:
    p = sub.add_parser(
        "diff", help="compare two releases config by config: rows added/removed, label shifts, biased features, "
                     "recipe and input changes",
        description="Compare two releases, OLD and NEW: each a release folder written by `debiased-nli build`, or a "
                    "Hub dataset repo as ORG/NAME@REVISION (ORG/NAME alone: its main branch; downloaded with "
                    "huggingface_hub). For every config and split: rows added and removed (matched by uid, and by "
                    "content where the uids differ: 'moved'), rows edited or relabelled, each label's count before "
                    "and after, and the z of the top features per label in each release (the task's lexical "
                    "features; the hypothesis-only feature is not stored in a release); then which recipe settings, "
                    "inputs, seed and library versions differ (manifest.json). Prints markdown to paste into a "
                    "release note; `debiased-nli push --diff-against OLD` puts its one-line summary into the "
                    "version history and the table into the commit description. Exit status: 0 when the two "
                    "releases have the same rows in every config and split, 1 when they differ, 2 on bad input.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("old", metavar="OLD", help="the earlier release: a folder or ORG/NAME@REVISION")
    p.add_argument("new", metavar="NEW", help="the later release: a folder or ORG/NAME@REVISION")
    p.add_argument("--top-k", type=NON_NEGATIVE_INT, default=5,
                   help="features per label (by z, in either release) to show; 0 leaves the feature table out")
    p.add_argument("--out", metavar="FILE", help="also write the markdown to FILE")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON instead of markdown")
    p.set_defaults(func=run)


def run(args) -> int:
    import json

    from ...api import diff

    d = diff(args.old, args.new, top_k=args.top_k, out=args.out)
    print(json.dumps(d.to_dict(), indent=2, default=str) if args.json else d.markdown(), end="" if not args.json else "\n")
    print(("identical: " if d.identical else "different: ") + d.summary(), file=sys.stderr)
    return 0 if d.identical else 1
