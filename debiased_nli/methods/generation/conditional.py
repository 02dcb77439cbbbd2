"""A conditional sequence format: ``p(x | controls, y)``, the controls and the label as a prefix.

One row becomes one text::

    {start}bias: b3\\nlabel: {l}\\npremise: {P}\\nhypothesis: {H}{end}
    `-------------- prefix ---------------'`------------- x -------------'

The *controls* are named ``name: value`` lines before the label (IBADR, Wang et al. 2023, Eq. 1: the
bias indicator b; none for its "w/o bias indicator" ablation); values are written as text, so a LoRA
generator needs no new embeddings. The loss covers x only (premise and hypothesis with their
markers and the end marker): :meth:`ConditionalFormat.encode` returns a ``loss_mask`` that is 0 on
every token that overlaps the prefix, so the model is trained on ``-log p(x | prefix)``.

The generation prompt is the prefix plus ``premise:`` *without* the trailing space (as in
:mod:`.format`: in training the space belongs to the premise's first token), so its tokens are a
prefix of the training sequence's tokens. A sample (prompt + continuation) is parsed back by
checking the prefix and cutting x at the first end marker; the reasons a sample is unparseable are
those of :mod:`.format`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from ...data.tasks import TaskSpec
from ...utils.errors import ConfigError
from .format import (
    EMPTY_HYPOTHESIS,
    EMPTY_PREMISE,
    FALLBACK_END,
    HYPOTHESIS_MARKER,
    NO_END,
    NO_HYPOTHESIS_MARKER,
    NO_PREMISE_MARKER,
    PREMISE_MARKER,
    UNKNOWN_LABEL,
    _clean,
    _overlaps,
    label_name,
)

LABEL_LINE = "label: "
CONTROL_PREFIX = "control_"  # a training set's column ``control_<name>`` holds the value of control <name>
NO_PREFIX = "the sample does not start with its prompt's prefix"
LOSS_MASK = "loss_mask"


@dataclasses.dataclass(frozen=True)
class ConditionalFormat:
    """``controls, label -> premise, hypothesis`` sequences for one tokenizer and one label set."""

    labels: tuple[str, ...]
    controls: tuple[str, ...] = ("bias",)
    start: str = ""
    end: str = FALLBACK_END

    @classmethod
    def for_tokenizer(cls, tokenizer, labels: Sequence[str], controls: Sequence[str] = ("bias",)) -> "ConditionalFormat":
        return cls(tuple(labels), tuple(controls), start=tokenizer.bos_token or "",
                   end=tokenizer.eos_token or FALLBACK_END)

    def _label(self, label: Any) -> str:
        return label_name(self.labels, label)

    def prefix(self, label: Any, controls: Mapping[str, Any] | None = None) -> str:
        """``{start}name: value\\n...label: l\\n``: what x is conditioned on."""
        controls = dict(controls or {})
        if set(controls) != set(self.controls):
            raise ConfigError(f"this format's controls are {list(self.controls)}; got {sorted(controls)}")
        text = self.start
        for name in self.controls:
            value = str(controls[name])
            if not value or "\n" in value:
                raise ConfigError(f"control {name!r} must be a non-empty one-line value, got {value!r}")
            text += f"{name}: {value}\n"
        return text + LABEL_LINE + self._label(label) + "\n"

    def prompt(self, label: Any, controls: Mapping[str, Any] | None = None) -> str:
        """The generation prompt: the prefix and the premise marker without its trailing space."""
        return self.prefix(label, controls) + PREMISE_MARKER.rstrip(" ")

    def spans(self, premise: str, label: Any, hypothesis: str, controls: Mapping[str, Any] | None = None
              ) -> tuple[str, dict[str, tuple[int, int]]]:
        """The sequence text and the character spans of ``prefix``, ``x``, ``premise``, ``hypothesis``, ``end``."""
        pre = self.prefix(label, controls)
        p, h = _clean(premise), _clean(hypothesis)
        text = pre + PREMISE_MARKER + p + HYPOTHESIS_MARKER + h + self.end
        p0 = len(pre) + len(PREMISE_MARKER)
        h0 = p0 + len(p) + len(HYPOTHESIS_MARKER)
        return text, {"prefix": (0, len(pre)), "x": (len(pre), len(text)), "premise": (p0, p0 + len(p)),
                      "hypothesis": (h0, h0 + len(h)), "end": (h0 + len(h), len(text))}

    def text(self, premise: str, label: Any, hypothesis: str, controls: Mapping[str, Any] | None = None) -> str:
        return self.spans(premise, label, hypothesis, controls)[0]

    def encode(self, tokenizer, premise: str, label: Any, hypothesis: str,
               controls: Mapping[str, Any] | None = None) -> dict[str, list[int]]:
        """Token ids and, per token, ``loss_mask`` (1 on x's tokens, 0 on every token touching the prefix)
        and ``hypothesis`` (1 on the hypothesis' tokens)."""
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(f"{type(tokenizer).__name__} is not a fast tokenizer; character offsets "
                              f"(return_offsets_mapping) need one: load it with use_fast=True")
        text, spans = self.spans(premise, label, hypothesis, controls)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        in_prefix = _overlaps(offsets, *spans["prefix"])
        # a special token (BOS) may report an empty span: it belongs to the prefix when it starts there
        in_prefix |= (offsets[:, 1] <= spans["prefix"][1]) & (offsets[:, 0] < spans["prefix"][1])
        return {"input_ids": list(enc["input_ids"]), LOSS_MASK: (~in_prefix).astype(int).tolist(),
                "hypothesis": _overlaps(offsets, *spans["hypothesis"]).astype(int).tolist()}

    def parse(self, sample: str) -> tuple[dict[str, str] | None, str | None]:
        """A generated text (prompt + continuation) -> ({premise, label, hypothesis, *controls}, None)
        or (None, reason)."""
        text = sample
        if self.start and text.startswith(self.start):
            text = text[len(self.start):]
        row: dict[str, str] = {}
        for name in self.controls + ("label",):
            head = f"{name}: "
            if not text.startswith(head) or "\n" not in text:
                return None, NO_PREFIX
            value, _, text = text[len(head):].partition("\n")
            row[name] = value.strip()
        if row["label"] not in self.labels:
            return None, UNKNOWN_LABEL
        cut = text.find(self.end)
        if cut < 0:
            return None, NO_END
        text = text[:cut]
        marker = PREMISE_MARKER.rstrip(" ")
        if not text.startswith(marker):
            return None, NO_PREMISE_MARKER
        premise, sep, hypothesis = text[len(marker):].partition(HYPOTHESIS_MARKER.rstrip(" "))
        if not sep:
            return None, NO_HYPOTHESIS_MARKER
        premise, hypothesis = premise.strip(), hypothesis.strip()
        if not premise:
            return None, EMPTY_PREMISE
        if not hypothesis:
            return None, EMPTY_HYPOTHESIS
        return {**row, "premise": premise, "hypothesis": hypothesis}, None


def controls_of(ds) -> tuple[str, ...]:
    """The controls of a conditional training set: its ``control_<name>`` columns, in column order."""
    return tuple(c[len(CONTROL_PREFIX):] for c in ds.column_names if c.startswith(CONTROL_PREFIX))


def encode_conditional(ds, task: TaskSpec, tokenizer, *, max_length: int = 128, progress: bool = True):
    """Tokenised training rows for ``mode="conditional"`` of :func:`.train.train_generator`. The
    controls are the ``control_<name>`` columns of ``ds`` (none: ``p(x | y)``). Gives ``input_ids``,
    ``loss_mask``, ``hypothesis`` and an all-zero ``bias`` mask (the collator pads it with the other modes')."""
    controls = controls_of(ds)
    fmt = ConditionalFormat.for_tokenizer(tokenizer, task.labels, controls)

    def enc(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], LOSS_MASK: [], "hypothesis": [], "bias": []}
        for i, (p, lab, h) in enumerate(zip(batch["premise"], batch["label"], batch["hypothesis"])):
            e = fmt.encode(tokenizer, p, lab, h, {c: batch[CONTROL_PREFIX + c][i] for c in controls})
            for k in ("input_ids", LOSS_MASK, "hypothesis"):
                out[k].append(e[k][:max_length])
            out["bias"].append([0] * len(out["input_ids"][-1]))
        return out

    return ds.map(enc, batched=True, batch_size=256, remove_columns=ds.column_names,
                  desc="encoding (conditional)" if progress else None)
