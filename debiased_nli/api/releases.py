"""The dataset side of the API: :func:`build` a release, :func:`push` it to the Hub, :func:`diff` two releases,
:func:`audit` a dataset. Each is what its command does (``debiased-nli build``, ``push``, ``diff``, ``audit``),
with the same checks and the same files written, returning a result object instead of printing."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ..utils.params import options_of
from .options import AuditOptions, BuildOptions

if TYPE_CHECKING:  # the heavy modules are imported when a function runs, not with the package
    from ..bias.zstats import ZStats
    from ..data.tasks import TaskSpec
    from ..release.diff import ReleaseDiff
    from ..release.recipe import BuildResult


def build(recipe: "str | os.PathLike[str] | Mapping[str, Any]", out: "str | os.PathLike[str]", *,
          options: BuildOptions | None = None, **values: Any) -> "BuildResult":
    """Build a release folder from a recipe (``debiased-nli build``).

        dn.build("snli", "out/snli", data_files=["train=train.parquet"], profile="paper")

    Args:
        recipe: a recipe YAML file, the name of a packaged recipe (``"demo"``, ``"snli"``: ``builders/<name>.yaml``)
            or the recipe itself as a mapping.
        out: the release folder to write: new, or (with ``overwrite``) a release this tool wrote; written under a
            temporary name and renamed when complete.
        options: every other option at once, a :class:`~debiased_nli.api.options.BuildOptions`.
        **values: any option of :class:`~debiased_nli.api.options.BuildOptions` by name (``data_files``,
            ``new_rows``, ``profile``, ``max_rows``, ``seed``, ``overwrite``, ...), replacing that field of
            ``options``. An unknown name is refused with the closest one.

    Returns:
        The :class:`~debiased_nli.release.recipe.BuildResult`: ``out_dir``, the train rows of each config, the
        manifest, each step's report; ``load_dataset(str(result.out_dir), config)`` opens a config.
    """
    o = options_of(BuildOptions, options, values, "build()")

    from ..release.recipe import build as build_release
    from ..release.recipe import is_main_rank
    from ..utils.resources import find_recipe

    path = recipe if isinstance(recipe, Mapping) else find_recipe(recipe)
    result = build_release(path, out, data_files=o.data_files, new_rows_files=o.new_rows, overwrite=o.overwrite,
                           seed=o.seed, progress=o.progress and is_main_rank(), max_rows=o.max_rows,
                           profile=o.profile, efficacy=o.efficacy, timings=o.timings, replay=o.replay,
                           quality=o.quality)
    result.recipe_path = None if isinstance(path, Mapping) else Path(path)
    if o.prune_cache and is_main_rank():
        from ..utils.cache import prune_cache as prune

        result.pruned = prune()
    return result


@dataclasses.dataclass
class PushResult:
    """What :func:`push` did on the Hub."""

    repo_id: str
    commit: str
    commit_url: str
    tag: str | None
    files: int                       # files in the commit
    deleted: list[str]               # files of the previous release that this one lacks, deleted in the commit
    diff: "ReleaseDiff | None" = None  # the comparison with diff_against, when given

    def load_snippet(self) -> str:
        """The line that loads a config of the pushed release."""
        return f"datasets.load_dataset({self.repo_id!r}, CONFIG{', revision=' + repr(self.tag) if self.tag else ''})"


def push(folder: "str | os.PathLike[str]", repo_id: str, *, revision: str | None = None, private: bool = False,
         message: str | None = None, note: str | None = None, diff_against: str | None = None,
         token: str | None = None, endpoint: str | None = None) -> PushResult:
    """Publish a release folder as the Hub dataset repo ``repo_id`` (``debiased-nli push``).

    One commit uploads exactly the release's own files (those its manifest lists, sha256-checked) and deletes
    the data files of an earlier release that this one lacks; ``revision`` tags it (``v1.0``; tags are
    immutable). The version history is merged with the one on the Hub; every request runs within
    ``$DEBIASED_NLI_HUB_TIMEOUT`` / ``$DEBIASED_NLI_HUB_DEADLINE``.

    Args:
        folder: a release folder written by :func:`build`.
        repo_id: ``ORG/NAME`` of the dataset repo (created if needed).
        revision: the version tag of this release.
        private: create the repo as private.
        message: the commit message.
        note: what changed in this version, for the card's history (default: ``published``, or the one-line
            summary of ``diff_against``).
        diff_against: an earlier release (folder or ``ORG/NAME@REVISION``): its summary becomes the note and its
            table the commit's description.
        token: a Hub token (default: ``HF_TOKEN`` or the logged-in one); never printed or stored.
        endpoint: another Hub (default: ``HF_ENDPOINT`` or huggingface.co).
    """
    from ..release.publish import push_release

    d = None
    if diff_against:
        from ..release.diff import diff_releases

        d = diff_releases(diff_against, folder)
        note = note or d.summary()
    out = push_release(folder, repo_id, revision=revision, private=private, token=token, commit_message=message,
                       endpoint=endpoint, note=note, commit_description=d.markdown() if d is not None else None)
    return PushResult(repo_id=out["repo_id"], commit=out["commit"], commit_url=out["commit_url"], tag=out["tag"],
                      files=out["files"], deleted=list(out["deleted"]), diff=d)


def diff(old: "str | os.PathLike[str]", new: "str | os.PathLike[str]", *, top_k: int = 5,
         out: "str | os.PathLike[str] | None" = None, progress: bool = False) -> "ReleaseDiff":
    """Compare two releases config by config (``debiased-nli diff``).

    Args:
        old: the earlier release: a folder, or a Hub dataset repo as ``ORG/NAME@REVISION``.
        new: the later release, the same way.
        top_k: features per label (by z, in either release) to compare; 0 leaves the feature table out.
        out: also write the markdown there (never over a file this tool did not write).
        progress: show progress bars.

    Returns:
        The :class:`~debiased_nli.release.diff.ReleaseDiff`: ``identical``, ``summary()``, ``markdown()``,
        ``to_dict()``.
    """
    from ..release.diff import diff_releases
    from ..utils.outputs import OwnFiles

    # out: checked before the comparison, written under a temporary name and renamed when whole
    own = OwnFiles([Path(out)], what=f"--out {out}") if out else None
    d = diff_releases(old, new, top_k=top_k, progress=progress)
    if own is not None:
        with own:
            own.write_text(Path(out), d.markdown())
    return d


@dataclasses.dataclass
class AuditResult:
    """What :func:`audit` found: the ``audit.json`` report, the files written, the z-statistics."""

    report: dict[str, Any]
    paths: dict[str, Path]
    zstats: "ZStats | None" = None

    def top_features(self, label: str, k: int = 5) -> list[str]:
        """The ``k`` features with the largest z for ``label``."""
        return [r["feature"] for r in self.report["features"] if r["label"] == label][:k]


def audit(task: "str | TaskSpec", *, out: "str | os.PathLike[str] | None" = None, options: AuditOptions | None = None,
          **values: Any) -> AuditResult:
    """Audit a dataset for spurious feature-label correlations (``debiased-nli audit``; Gardner et al. 2021).

        dn.audit("snli", data_files="train.parquet", out="audit/")

    Args:
        task: a registered task (``"snli"``, ``"mnli"``, ...), a task YAML file or a
            :class:`~debiased_nli.data.tasks.TaskSpec`.
        out: write ``audit.json``, ``audit.md`` and ``zstats.png`` there (an audit folder of this tool, new or
            replaced whole); None writes nothing.
        options: every other option at once, an :class:`~debiased_nli.api.options.AuditOptions`.
        **values: any option of :class:`~debiased_nli.api.options.AuditOptions` by name (``data_files``,
            ``split``, ``max_rows``, ``top_k``, ``z_threshold``, ``hypothesis_only``, ...), replacing that field of
            ``options``. An unknown name is refused with the closest one.
    """
    o = options_of(AuditOptions, options, values, "audit()")

    from ..bias.audit import audit_zstats, write_audit
    from ..data.loading import load_task, parse_data_files, require_two_labels
    from ..data.tasks import get_task
    from ..utils.outputs import check_target, is_audit_folder

    task = get_task(task)
    inputs = [f for files in (parse_data_files(o.data_files) or {}).values() for f in files]
    if out is not None:
        check_target(out, overwrite=True, must_be_new=False, is_ours=is_audit_folder, what="audit", inputs=inputs)
    loaded = load_task(task, o.split, data_files=o.data_files, on_invalid=o.on_invalid, revision=o.revision,
                       max_rows=o.max_rows)
    hyp = None if o.hypothesis_only is None or str(o.hypothesis_only).lower() == "none" else o.hypothesis_only
    if hyp not in (None, "tfidf"):
        from ..utils.paths import check_model_reference

        check_model_reference(hyp, "--hypothesis-only")
    require_two_labels(loaded.dataset, task, f"{task.name} split {o.split!r}")
    report, zs = audit_zstats(loaded.dataset, task, top_k=o.top_k, p0=o.p0, z_threshold=o.z_threshold, alpha=o.alpha,
                              hypothesis_only=hyp, seed=o.seed, progress=o.progress)
    report["source"] = loaded.source
    report["counts"] = loaded.counts
    paths = write_audit(report, out, zs, set_aside=loaded.set_aside, inputs=inputs) if out is not None else {}
    return AuditResult(report=report, paths=dict(paths), zstats=zs)
