"""Padding-free forward passes of BERT encoders for PDD's teacher and masked-LM fill (speed only).

PDD runs the teacher on every candidate that passes the containment check and the masked LM on every
masked prompt (Guo et al. 2023, section 3.3.2); on CPU that is most of a run's time. The straightforward
forward pass pads a batch to its longest sequence and computes every layer at every position. Here:

- **No padding.** Sequences are tokenised once, without padding, and grouped by exact length. The
  linear layers (Q, K, V, attention output, feed-forward) and the layer norms run on all tokens of all
  sequences at once, as one packed ``[tokens, hidden]`` matrix (large matrix products, no padded rows);
  only attention runs per length group, as ``[sequences, heads, length, head_dim]`` with no mask.
- **Only the positions that are read.** The teacher reads the ``[CLS]`` state (the pooler), the fill
  reads the mask positions. The last layer therefore computes keys and values at every position but
  queries, attention output and feed-forward only at those positions (in a 6-layer MiniLM, about 14%
  of the work).

The arithmetic is the model's own (its ``nn.Linear``, ``nn.LayerNorm``, activation and embedding
modules, ``scaled_dot_product_attention`` with the model's scaling), so the outputs equal those of the
padded forward pass up to float rounding in the last bits (a different summation order in the matrix
products). tests/test_pdd_speed.py pins that on tiny models, and benchmarks/bench_pdd.py checks on
the real data that every teacher choice and every fill candidate stays the same.

:func:`supports` says whether a model can take this path (BERT-style encoders: absolute positions,
no decoder, no cross-attention); the teacher and the filler fall back to the model's own forward pass
(still unpadded, one exact-length group at a time) for anything else, e.g. XLM-R.
"""
from __future__ import annotations

from typing import Any, Sequence

# tokens per packed chunk when the caller gives none; bounds the activations held at once
DEFAULT_MAX_TOKENS = 8192


def _encoder_of(model: Any):
    """The ``BertModel`` inside a BERT task model (``model.bert``), or the model itself."""
    return getattr(model, "bert", model)


def supports(model: Any) -> bool:
    """Whether :class:`PackedBert` computes the same function as ``model``'s own forward pass."""
    enc = _encoder_of(model)
    cfg = getattr(enc, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) != "bert":
        return False
    if getattr(cfg, "is_decoder", False) or getattr(cfg, "add_cross_attention", False):
        return False
    if getattr(cfg, "position_embedding_type", "absolute") != "absolute":
        return False
    if getattr(cfg, "chunk_size_feed_forward", 0):
        return False
    if getattr(cfg, "_attn_implementation", "eager") not in ("eager", "sdpa"):
        return False
    emb, layers = getattr(enc, "embeddings", None), getattr(getattr(enc, "encoder", None), "layer", None)
    if emb is None or layers is None or type(emb).__name__ != "BertEmbeddings":
        return False
    return all(type(layer).__name__ == "BertLayer" and not hasattr(layer, "crossattention") for layer in layers)


def length_groups(lengths: Sequence[int], max_tokens: int) -> list[list[list[int]]]:
    """Chunks of sequence indices, each chunk a list of exact-length groups, at most ``max_tokens``
    tokens a chunk (a single sequence longer than that is a chunk of its own). Groups are in increasing
    length, indices in increasing order inside a group: the grouping depends only on the lengths."""
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_len.setdefault(int(n), []).append(i)
    chunks: list[list[list[int]]] = []
    cur: list[list[int]] = []
    used = 0
    for n in sorted(by_len):
        idx, start, width = by_len[n], 0, max(n, 1)
        while start < len(idx):
            room = (max_tokens - used) // width
            if room < 1:
                if cur:
                    chunks.append(cur)
                    cur, used = [], 0
                    continue
                room = 1  # one sequence longer than max_tokens
            take = idx[start:start + room]
            cur.append(take)
            used += len(take) * width
            start += len(take)
    if cur:
        chunks.append(cur)
    return chunks


class PackedBert:
    """Hidden states of a BERT encoder at chosen positions, computed without padding (module docstring)."""

    def __init__(self, model: Any, max_tokens: int = DEFAULT_MAX_TOKENS):
        if not supports(model):
            raise ValueError(f"{type(model).__name__} is not a BERT encoder this path supports (see encoder.supports)")
        self.encoder = _encoder_of(model)
        cfg = self.encoder.config
        self.heads = int(cfg.num_attention_heads)
        self.head_dim = int(cfg.hidden_size) // self.heads
        self.max_tokens = int(max_tokens)

    def hidden_at(self, input_ids: Sequence[Sequence[int]], token_type_ids: Sequence[Sequence[int]] | None,
                  positions: Sequence[Sequence[int]]):
        """``[sum(len(p) for p in positions), hidden]``: the last layer's states of sequence i at
        ``positions[i]``, sequence by sequence, in the order given."""
        import torch

        n = len(input_ids)
        dev = self.encoder.embeddings.word_embeddings.weight.device
        out_rows: list[Any] = [None] * n
        lengths = [len(s) for s in input_ids]
        with torch.inference_mode():
            for chunk in length_groups(lengths, self.max_tokens):
                groups = []
                for idx in chunk:
                    ids = torch.tensor([list(input_ids[i]) for i in idx], dtype=torch.long, device=dev)
                    tt = (torch.tensor([list(token_type_ids[i]) for i in idx], dtype=torch.long, device=dev)
                          if token_type_ids is not None else torch.zeros_like(ids))
                    groups.append((idx, ids, tt))
                hidden = self._forward_chunk(groups, positions)
                start = 0
                for idx, _, _ in groups:
                    for i in idx:
                        k = len(positions[i])
                        out_rows[i] = hidden[start:start + k]
                        start += k
            if not n:
                return torch.zeros(0, self.encoder.config.hidden_size)
            return torch.cat(out_rows, dim=0)

    # -- one chunk -----------------------------------------------------------------------------------
    def _attend(self, q, k, v, scaling):
        import torch.nn.functional as F

        return F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=scaling, is_causal=False)

    def _forward_chunk(self, groups, positions):
        import torch

        enc = self.encoder
        shapes = [(len(idx), int(ids.shape[1])) for idx, ids, _ in groups]
        hid = int(enc.config.hidden_size)
        x = torch.cat([enc.embeddings(input_ids=ids, token_type_ids=tt).reshape(-1, hid) for _, ids, tt in groups], dim=0)
        # packed row of every read position, group by group, sequence by sequence
        sel, off = [], 0
        for (idx, _, _), (b, L) in zip(groups, shapes):
            for r, i in enumerate(idx):
                for p in positions[i]:
                    if not 0 <= p < L:
                        raise IndexError(f"position {p} outside a sequence of {L} tokens")
                    sel.append(off + r * L + p)
            off += b * L
        sel_t = torch.tensor(sel, dtype=torch.long, device=x.device)
        layers = enc.encoder.layer
        for li, layer in enumerate(layers):
            last = li == len(layers) - 1
            att = layer.attention
            sa = att.self
            k = sa.key(x)
            v = sa.value(x)
            q_in = x.index_select(0, sel_t) if last else x
            q = sa.query(q_in)
            ctx = self._attention(q, k, v, shapes, groups, positions, last, sa.scaling)
            resid = q_in
            h = att.output.LayerNorm(att.output.dense(ctx) + resid)
            inter = layer.intermediate.intermediate_act_fn(layer.intermediate.dense(h))
            x = layer.output.LayerNorm(layer.output.dense(inter) + h)
        if not len(layers):
            x = x.index_select(0, sel_t)
        return x

    def _attention(self, q, k, v, shapes, groups, positions, last: bool, scaling):
        """Self-attention per length group. Not ``last``: every position queries its sequence. ``last``:
        ``q`` holds only the read positions (in ``hidden_at``'s order)."""
        import torch

        H, D = self.heads, self.head_dim
        outs, off, qoff = [], 0, 0
        for (idx, _, _), (b, L) in zip(groups, shapes):
            kg = k[off:off + b * L].view(b, L, H, D).transpose(1, 2)
            vg = v[off:off + b * L].view(b, L, H, D).transpose(1, 2)
            if not last:
                qg = q[off:off + b * L].view(b, L, H, D).transpose(1, 2)
                o = self._attend(qg, kg, vg, scaling)                    # [b, H, L, D]
                outs.append(o.transpose(1, 2).reshape(b * L, H * D))
            else:
                counts = [len(positions[i]) for i in idx]
                m = sum(counts)
                if m:
                    seq = torch.repeat_interleave(torch.arange(b, device=k.device),
                                                  torch.tensor(counts, device=k.device))
                    qg = q[qoff:qoff + m].view(m, 1, H, D).transpose(1, 2)   # [m, H, 1, D]
                    if m == b and all(c == 1 for c in counts):
                        kk, vv = kg, vg
                    else:
                        kk, vv = kg.index_select(0, seq), vg.index_select(0, seq)
                    o = self._attend(qg, kk, vv, scaling)                    # [m, H, 1, D]
                    outs.append(o.transpose(1, 2).reshape(m, H * D))
                qoff += m
            off += b * L
        return torch.cat(outs, dim=0) if outs else q.new_zeros((0, H * D))
