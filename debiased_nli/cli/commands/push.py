"""``debiased-nli push``: publish a release folder as a Hub dataset repo with a version tag."""
from __future__ import annotations

import sys

from ._common import DefaultsHelpFormatter


def register(sub) -> None:
    p = sub.add_parser(
        "push", help="publish a release folder to the Hugging Face Hub (one commit, one tag per version)",
        description="Create the dataset repo ORG/NAME (if needed), upload the release folder as one commit that also "
                    "deletes the data files of an earlier release that this one lacks, and tag it with --revision. "
                    "The version history (manifest.json, rendered into the card) is merged with the one on the Hub, "
                    "and the card's load snippet is pointed at ORG/NAME. "
                    "The token comes from HF_TOKEN or `huggingface-cli login`; it is never printed or stored.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("folder", help="a release folder written by `debiased-nli build`")
    p.add_argument("--repo-id", required=True, help="ORG/NAME of the dataset repo")
    p.add_argument("--revision", help="version tag for this release, e.g. v1.0 (tags are immutable)")
    p.add_argument("--private", action="store_true", help="create the repo as private")
    p.add_argument("--message", help="commit message")
    p.add_argument("--note", help="what changed in this version, for the card's version history (default: published, "
                                  "or the one-line summary of --diff-against)")
    p.add_argument("--diff-against", metavar="OLD",
                   help="compare the folder with an earlier release first (a folder, or ORG/NAME@REVISION such as the "
                        "repo's previous tag; see `debiased-nli diff`): its one-line summary becomes the version "
                        "history's note (unless --note is given), its markdown table the commit's description on the "
                        "Hub, and the table is printed")
    p.set_defaults(func=run)


def run(args) -> int:
    from ...api import push

    out = push(args.folder, args.repo_id, revision=args.revision, private=args.private, message=args.message,
               note=args.note, diff_against=args.diff_against)
    if out.diff is not None:
        print(out.diff.markdown())
    print(f"pushed {out.files} files to {out.repo_id} (commit {out.commit[:10]}"
          f"{', tag ' + out.tag if out.tag else ''}"
          f"{'; deleted ' + str(len(out.deleted)) + ' file(s) of the previous release' if out.deleted else ''})",
          file=sys.stderr)
    print(f"load it with: {out.load_snippet()}")
    return 0
