"""Sequence packing: the update trains on real tokens, not on padding.

A :class:`~fbos_jax.rl.batch.PolicyBatch` pads every prompt to its bucket and
every response to ``sampling.max_new_tokens``; with long-tailed responses most
of its positions are padding. :func:`pack_batches` lays each term's sequences
(the real prompt tokens, then the response up to its last loss token) end to
end in rows of the batch's padded row length ``L = P + R`` (so the longest
sequence always fits whole), first-fit decreasing, with segment ids
(:class:`~fbos_jax.rl.batch.PackedBatch`):

* attention never crosses a segment and positions restart per segment
  (``qwen.forward(segment_ids=...)``), so every sequence gets the log-probs it
  gets padded;
* the loss mask, advantage, old log-prob, off-policy flag and the seq-* modes'
  per-sequence weight sit at the position that predicts each response token;
* rows whose loss mask is empty (padding rows, GFPO-rejected rows) add nothing
  to any sum or denominator and are dropped.

Micro-batches by token budget (``rl.micro_batch_tokens`` = B tokens per batch
shard): a micro-batch is ``B // L`` packed rows on each batch shard, and a
batch takes as many micro-batches as its real tokens need, rounded up to a
bucket (:func:`fbos_jax.buckets.bucket_count`: 1, 2, 3, 4, 6, 8, ...;
:func:`packed_shape`): one program per bucket (the run's compile set holds them
all, ``fbos_jax/rl/shapes.py:update_programs``). With ``rl.fixed_row_buckets``
every batch has the most micro-batches its rows can fill, one program per prompt
bucket, and the update skips (``lax.cond``) the micro-batches that hold no
sequence: it computes what the real tokens need, in a compile set as small as
the padded run's. Empty rows: the bucket's
rounding (at most a third of the micro-batches) and the last micro-batch's
rest. Hosts agree on the shape by one all-gather of their packed-row counts. The
denominators of the objective are those of the masks, as before, computed once
per (mini-)batch in the update: packing changes the layout, not the loss
(``tests/test_packing.py``: gradients equal the padded update's).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fbos_jax import buckets
from fbos_jax import distributed
from fbos_jax import sharding as sh
from fbos_jax.rl.batch import PackedBatch, PolicyBatch


@dataclasses.dataclass
class Layout:
  """Where a batch's sequences go: ``rows[i]`` the (padded) row of each kept
  sequence, ``bins`` the kept rows of each packed row in order, their lengths
  ``lengths`` (prompt ``prompt_lens`` + response up to the last loss token)."""
  rows: np.ndarray
  prompt_lens: np.ndarray
  lengths: np.ndarray
  bins: list
  row_len: int


def sequences(batch: PolicyBatch) -> tuple:
  """(rows, prompt tokens, sequence lengths) of the rows of ``batch`` (host numpy)
  that have a loss token: the real prompt tokens, then the response up to its
  last loss token (later tokens change no loss). Refuses (ValueError, naming the
  row) a loss token on a response pad or a sequence without a prompt token."""
  p, r = batch.prompt_len, batch.response_len
  lm = np.asarray(batch.loss_mask) != 0
  am = np.asarray(batch.attn_mask) != 0
  rows = np.flatnonzero(lm.any(axis=1))
  last = r - np.argmax(lm[rows, ::-1], axis=1)  # response tokens up to the last loss token
  plen = am[rows, :p].sum(axis=1)
  for i, n_resp, n_prompt in zip(rows, last, plen):
    if not am[i, p:p + n_resp].all():
      raise ValueError(f"packing: row {i} has a loss token after a padded response position")
    if n_prompt == 0:
      raise ValueError(f"packing: row {i} has no prompt token to predict its first response "
                       "token from")
  return rows, plen, plen + last


def layout(batch: PolicyBatch) -> Layout:
  """First-fit-decreasing placement of ``batch``'s :func:`sequences` in rows of
  its padded row length."""
  rows, plen, lengths = sequences(batch)
  row_len = batch.prompt_len + batch.response_len
  return Layout(rows, plen, lengths, first_fit_decreasing(lengths, row_len), row_len)


def first_fit_decreasing(lengths, capacity: int) -> list:
  """Bins (lists of indices into ``lengths``) of at most ``capacity`` tokens:
  the longest sequence first, each into the first bin with room."""
  lengths = np.asarray(lengths, np.int64)
  if lengths.size and lengths.max() > capacity:
    raise ValueError(f"packing: a sequence of {lengths.max()} tokens exceeds the row of "
                     f"{capacity}")
  room = np.zeros(len(lengths), np.int64)  # free tokens of each bin so far
  bins: list = []
  for j in np.argsort(-lengths, kind="stable"):
    fits = np.flatnonzero(room[:len(bins)] >= lengths[j])
    if fits.size:
      b = int(fits[0])
    else:
      b = len(bins)
      bins.append([])
      room[b] = capacity
    bins[b].append(int(j))
    room[b] -= lengths[j]
  return bins


def packed_shape(packed_rows: int, row_len: int, micro_batch_tokens: int, shards: int,
                 mini_batches: int) -> tuple:
  """(micro-batches per mini-batch, rows) of a batch of ``packed_rows`` rows of
  ``row_len`` tokens over ``shards`` batch shards: micro-batches of the budget's
  ``micro_batch_tokens // row_len`` rows per shard, the fewest that hold the batch
  rounded up to a :func:`fbos_jax.buckets.bucket_count` bucket (so a run's
  shapes are one per bucket). ValueError, naming the budget field, when the
  budget does not hold one row."""
  per_micro = int(micro_batch_tokens) // int(row_len)
  if per_micro < 1:
    raise ValueError(f"rl.micro_batch_tokens={micro_batch_tokens} does not hold one row of "
                     f"{row_len} tokens; raise it to >= {row_len}")
  per_shard = -(-int(packed_rows) // (int(shards) * int(mini_batches)))
  m = buckets.bucket_count(-(-per_shard // per_micro))
  return m, m * int(mini_batches) * per_micro * int(shards)


def pack(batch: PolicyBatch, lay: Layout, *, rows: int, micro_batches: int) -> PackedBatch:
  """``batch`` (host numpy) laid out as ``lay`` says in ``rows`` packed rows
  (the rest padding), with ``micro_batches`` micro-batches per mini-batch."""
  if len(lay.bins) > rows:
    raise ValueError(f"packing: {len(lay.bins)} packed rows do not fit {rows}")
  p, L = batch.prompt_len, lay.row_len
  tokens = np.zeros((rows, L), np.int32)
  seg = np.zeros((rows, L), np.int32)
  f32 = lambda: np.zeros((rows, L), np.float32)
  loss_mask, adv, old_logp, seq_weight = f32(), f32(), f32(), f32()
  off = np.zeros((rows, L), bool)
  src_tokens, src_am = np.asarray(batch.tokens), np.asarray(batch.attn_mask) != 0
  src_lm, src_old = np.asarray(batch.loss_mask), np.asarray(batch.old_logp)
  src_adv, src_off = np.asarray(batch.advantages), np.asarray(batch.is_offpolicy)
  for b, members in enumerate(lay.bins):
    at = 0
    for s, j in enumerate(members):
      i, n_p, n = lay.rows[j], int(lay.prompt_lens[j]), int(lay.lengths[j])
      n_r = n - n_p
      tokens[b, at:at + n_p] = src_tokens[i, :p][src_am[i, :p]]
      tokens[b, at + n_p:at + n] = src_tokens[i, p:p + n_r]
      seg[b, at:at + n] = s + 1
      # the position that predicts response token k is the one before it
      scored = slice(at + n_p - 1, at + n - 1)
      loss_mask[b, scored] = src_lm[i, :n_r]
      old_logp[b, scored] = src_old[i, :n_r]
      adv[b, scored] = src_adv[i]
      off[b, scored] = src_off[i]
      total = float(src_lm[i].sum())
      seq_weight[b, scored] = 1.0 / total if total else 0.0
      at += n
  return PackedBatch(tokens=tokens, segment_ids=seg, loss_mask=loss_mask, advantages=adv,
                     old_logp=old_logp, is_offpolicy=off, seq_weight=seq_weight,
                     response_len=batch.response_len, micro_batches=int(micro_batches))


def pack_batches(batches: dict, ucfg, shards: int) -> dict:
  """{name: PolicyBatch (host numpy, the same prompt bucket on every host)} ->
  {name: PackedBatch} under ``ucfg`` (:class:`fbos_jax.rl.config.UpdateConfig`,
  ``micro_batch_tokens`` > 0) with ``shards`` batch shards on this host: each
  batch's shape (:func:`packed_shape`) holds the most packed rows any host has
  (one all-gather), or with ``ucfg.fixed_micro_batches`` the most its padded rows
  can fill (one sequence per row: the same shape every step, no all-gather; the
  update skips the micro-batches left empty). Packed rows fill the rows in order,
  so the empty micro-batches are the last ones."""
  names = sorted(batches)
  lays = {n: layout(batches[n]) for n in names}
  if ucfg.fixed_micro_batches:
    agreed = [batches[n].num_rows for n in names]
  else:
    agreed = distributed.agree_max(*(len(lays[n].bins) for n in names))
  out = {}
  for n, most in zip(names, agreed):
    m, rows = packed_shape(most, lays[n].row_len, ucfg.micro_batch_tokens, shards,
                           ucfg.mini_batches)
    out[n] = pack(batches[n], lays[n], rows=rows, micro_batches=m)
  return out


def real_tokens(batch) -> int:
  """Tokens of the sequences a batch trains on (host numpy): a PolicyBatch's rows
  with a loss token, up to their last loss token; a PackedBatch's non-padding."""
  if isinstance(batch, PackedBatch):
    return int((np.asarray(batch.segment_ids) > 0).sum())
  return int(sequences(batch)[2].sum())


def computed_positions(batch, ucfg) -> int:
  """Positions of ``batch`` (host numpy, this host's rows) that the update
  computes: those of its row blocks (mini-batches x micro-batches, as
  :func:`fbos_jax.rl.update._split` cuts them) that hold a loss token; the
  update skips the others (``rl.fixed_row_buckets``'s empty micro-batches)."""
  from fbos_jax.rl import batch as batch_lib
  parts = int(ucfg.mini_batches) * batch_lib.micro_batches(batch, ucfg.micro_batches)
  mask = np.asarray(batch.loss_mask)
  blocks = mask.reshape((parts, -1) + mask.shape[1:]) if mask.shape[0] % parts == 0 else mask[None]
  per_block = int(np.prod(blocks.shape[1:])) // mask.shape[-1] * int(np.asarray(batch.tokens).shape[-1])
  return per_block * int(sum(bool((blk != 0).any()) for blk in blocks))


def device_batches(batches: dict, ucfg, mesh, rules) -> tuple:
  """The update's batches from the host's ({name: PolicyBatch}, numpy): packed
  when ``ucfg.packed`` (:func:`pack_batches`), each host's rows placed as its
  shard of the global batch. Returns (batches, metrics): ``update/real_token_frac``,
  the share of the positions the update computes (:func:`computed_positions`)
  that are real tokens."""
  if ucfg.packed:
    batches = pack_batches(batches, ucfg, sh.local_batch_shard_count(mesh, rules))
  positions = sum(computed_positions(b, ucfg) for b in batches.values())
  real = sum(real_tokens(b) for b in batches.values())
  from fbos_jax.rl import update as update_lib
  return update_lib.place_batches(batches, mesh, rules), {"update/real_token_frac": real / max(positions, 1)}
