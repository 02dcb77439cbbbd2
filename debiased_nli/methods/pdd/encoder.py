"""Padding-free forward passes of BERT encoders for PDD's teacher and masked-LM fill (speed only).

PDD runs the teacher on every candidate that passes the containment check and the masked LM on every
masked prompt (Guo et al. 2023, section 3.3.2); on CPU that is most of a run's time. The straightforward
forward pass pads a batch to its longest sequence and computes every layer at every position. Here:

- **No padding in the matrix products.** Sequences are tokenised once, without padding, sorted by
  length and cut into chunks. The linear layers (Q, K, V, attention output, feed-forward), the
  activation and the layer norms run on the real tokens of a chunk only, as one packed
  ``[tokens, hidden]`` matrix. Attention (a few percent of the work at these lengths) runs once per
  layer on the chunk padded to its longest sequence with a key mask, so a layer is a handful of large
  operations however many distinct lengths the chunk holds (per-length groups made hundreds of tiny
  ones, slow with 2 threads on a shared CPU).
- **Only the positions that are read.** The teacher reads the ``[CLS]`` state (the pooler), the fill
  reads the mask positions. The last layer therefore computes keys and values at every position but
  queries, attention output and feed-forward only at those positions (in a 6-layer MiniLM, about 14%
  of the work).

The arithmetic is the model's own (its ``nn.Linear``, ``nn.LayerNorm``, activation and embedding
modules, ``scaled_dot_product_attention`` with the model's scaling; the query, key and value weights
stacked into one matrix product), so the outputs equal those of the padded forward pass up to float
rounding in the last bits (a different summation order in the matrix products). The project's tests pin that on tiny models, and its PDD measurement checks on
the real data that every teacher choice and every fill candidate stays the same.

:func:`supports` says whether a model can take this path (BERT-style encoders: absolute positions,
no decoder, no cross-attention); for anything else (e.g. XLM-R) the teacher's and the filler's
``auto`` engine is the model's own padded forward pass, and ``bucketed`` its forward pass on groups of
exactly the same length (:func:`length_groups`).
"""
from __future__ import annotations

from typing import Any, Sequence

# padded tokens (sequences x longest) per chunk when the caller gives none; bounds the activations held
DEFAULT_MAX_TOKENS = 8192

# The arithmetic of the teacher's and the fill's forward passes: float32 (the default) or bfloat16 under
# torch.autocast (debiased_nli.utils.precision). bfloat16 can change a choice between near-tied candidates, or a
# sampled fill (the project's PDD measurement counts how often). The project's option: the paper does not say
# in which precision its BERT-base teacher and XLM-R fill ran.
from ...utils.precision import DTYPES, compute_context


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
    return all(type(layer).__name__ == "BertLayer" and not hasattr(layer, "crossattention")
               and all(getattr(layer.attention.self, n).bias is not None for n in ("query", "key", "value"))
               for layer in layers)


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


def sorted_chunks(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Sequence indices in increasing length (ties by index), cut into chunks whose padded size
    (sequences x longest) is at most ``max_tokens`` (a single longer sequence is a chunk of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: (int(lengths[i]), i))
    chunks: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * max(int(lengths[i]), 1) > max_tokens:
            chunks.append(cur)
            cur = []
        cur.append(i)
    if cur:
        chunks.append(cur)
    return chunks


class PackedBert:
    """Hidden states of a BERT encoder at chosen positions, computed without padding (module docstring).

    Per chunk of sequences (sorted by length): the linear layers and layer norms run on the packed
    ``[tokens, hidden]`` matrix (no padded rows); attention, a small part of the work, runs once per
    layer on the chunk padded to its longest sequence, with a key mask, so each layer is a handful of
    large operations whatever the number of distinct lengths."""

    def __init__(self, model: Any, max_tokens: int = DEFAULT_MAX_TOKENS):
        if not supports(model):
            raise ValueError(f"{type(model).__name__} is not a BERT encoder this path supports (see encoder.supports)")
        self.encoder = _encoder_of(model)
        cfg = self.encoder.config
        self.hidden = int(cfg.hidden_size)
        self.heads = int(cfg.num_attention_heads)
        self.head_dim = self.hidden // self.heads
        self.max_tokens = int(max_tokens)

    def hidden_at(self, input_ids: Sequence[Sequence[int]], token_type_ids: Sequence[Sequence[int]] | None,
                  positions: Sequence[Sequence[int]]):
        """``[sum(len(p) for p in positions), hidden]``: the last layer's states of sequence i at
        ``positions[i]``, sequence by sequence, in the order given."""
        import torch

        n = len(input_ids)
        for i in range(n):
            for p in positions[i]:
                if not 0 <= p < len(input_ids[i]):
                    raise IndexError(f"position {p} outside sequence {i} of {len(input_ids[i])} tokens")
        out_rows: list[Any] = [None] * n
        with torch.inference_mode():
            for chunk in sorted_chunks([len(s) for s in input_ids], self.max_tokens):
                hidden = self._forward_chunk([input_ids[i] for i in chunk],
                                             [token_type_ids[i] for i in chunk] if token_type_ids is not None else None,
                                             [positions[i] for i in chunk])
                start = 0
                for i in chunk:
                    k = len(positions[i])
                    out_rows[i] = hidden[start:start + k]
                    start += k
            if not n:
                return torch.zeros(0, self.hidden)
            return torch.cat(out_rows, dim=0)

    def _forward_chunk(self, ids, tts, positions):
        import torch
        import torch.nn.functional as F

        enc = self.encoder
        dev = enc.embeddings.word_embeddings.weight.device
        B, L = len(ids), max(len(s) for s in ids)
        H, NH, D = self.hidden, self.heads, self.head_dim
        pad_ids = torch.zeros(B, L, dtype=torch.long)
        pad_tt = torch.zeros(B, L, dtype=torch.long)
        valid = torch.zeros(B, L, dtype=torch.bool)
        for b, s in enumerate(ids):
            pad_ids[b, :len(s)] = torch.tensor(list(s), dtype=torch.long)
            if tts is not None:
                pad_tt[b, :len(s)] = torch.tensor(list(tts[b]), dtype=torch.long)
            valid[b, :len(s)] = True
        pad_ids, pad_tt, valid = pad_ids.to(dev), pad_tt.to(dev), valid.to(dev)
        flat = valid.reshape(-1).nonzero().squeeze(1)                  # padded row of every real token
        key_mask = valid[:, None, None, :]                             # [B, 1, 1, L]: attend to real keys only
        # the read positions: one padded query slot per position, S slots a sequence
        S = max(len(p) for p in positions)
        if S == 0:
            return torch.zeros(0, H, device=dev)
        q_slot = torch.zeros(B, S, dtype=torch.long)
        q_valid = torch.zeros(B, S, dtype=torch.bool)
        for b, ps in enumerate(positions):
            q_slot[b, :len(ps)] = torch.tensor(list(ps), dtype=torch.long)
            q_valid[b, :len(ps)] = True
        sel_padded = (torch.arange(B)[:, None] * L + q_slot)[q_valid].to(dev)   # padded rows read, in order
        row_of = torch.full((B * L,), -1, dtype=torch.long)
        row_of[flat.cpu()] = torch.arange(len(flat))
        sel_packed = row_of[sel_padded.cpu()].to(dev)                  # the same rows in the packed matrix
        q_out = q_valid.reshape(-1).nonzero().squeeze(1).to(dev)       # real slots of the [B * S] query grid

        x = enc.embeddings(input_ids=pad_ids, token_type_ids=pad_tt).reshape(B * L, H).index_select(0, flat)

        def to_heads(t, rows_index, width, parts):
            """packed [n, parts * H] -> ``parts`` tensors [B, NH, width, D], zeros in the padding."""
            full = t.new_zeros(B * width, parts * H).index_copy_(0, rows_index, t)
            full = full.view(B, width, parts, NH, D)
            return [full[:, :, j].transpose(1, 2) for j in range(parts)]

        layers = enc.encoder.layer
        for li, layer in enumerate(layers):
            last = li == len(layers) - 1
            att = layer.attention
            sa = att.self
            if not last:  # Q, K and V in one matrix product (the three weights stacked)
                q_in = x
                qkv = F.linear(x, torch.cat([sa.query.weight, sa.key.weight, sa.value.weight]),
                               torch.cat([sa.query.bias, sa.key.bias, sa.value.bias]))
                q, k, v = to_heads(qkv, flat, L, 3)
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, dropout_p=0.0, scale=sa.scaling)
                ctx = ctx.transpose(1, 2).reshape(B * L, H).index_select(0, flat)
            else:  # keys and values everywhere, queries only where read
                kv = F.linear(x, torch.cat([sa.key.weight, sa.value.weight]), torch.cat([sa.key.bias, sa.value.bias]))
                k, v = to_heads(kv, flat, L, 2)
                q_in = x.index_select(0, sel_packed)
                (q,) = to_heads(sa.query(q_in), q_out, S, 1)
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, dropout_p=0.0, scale=sa.scaling)
                ctx = ctx.transpose(1, 2).reshape(B * S, H).index_select(0, q_out)
            h = att.output.LayerNorm(att.output.dense(ctx) + q_in)
            inter = layer.intermediate.intermediate_act_fn(layer.intermediate.dense(h))
            x = layer.output.LayerNorm(layer.output.dense(inter) + h)
        if not len(layers):
            x = x.index_select(0, sel_packed)
        return x
