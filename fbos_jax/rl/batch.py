"""Batches that enter the jitted update step, and host-side helpers to build them.

A :class:`PolicyBatch` holds N sequences laid out as
``[prompt (left-padded to P) | response (right-padded to R)]``; the hidden state
at index ``P - 1 + j`` predicts response token ``j``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PolicyBatch:
  """N rows of (prompt, response) with everything the losses need.

  tokens:        [N, P + R] int32   prompt left-padded, response right-padded
  attn_mask:     [N, P + R] int32   1 on real prompt and response tokens
  loss_mask:     [N, R] float32     1 on response tokens that enter the loss
                                    (GFPO-rejected and padding rows are 0)
  advantages:    [N] float32        one advantage per response, broadcast to tokens
  old_logp:      [N, R] float32     log π_old of each response token as it was
                                    sampled (the behaviour policy; for an
                                    off-policy EPA row, under its FAP context)
  is_offpolicy:  [N] bool           take the f(u) loss instead of PPO clip
  """
  tokens: jax.Array
  attn_mask: jax.Array
  loss_mask: jax.Array
  advantages: jax.Array
  old_logp: jax.Array
  is_offpolicy: jax.Array

  @property
  def num_rows(self) -> int:
    return self.tokens.shape[0]

  @property
  def response_len(self) -> int:
    return self.loss_mask.shape[1]

  @property
  def prompt_len(self) -> int:
    return self.tokens.shape[1] - self.loss_mask.shape[1]


def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def bucket_rows(n: int, multiple: int, min_rows: int = 0) -> int:
  """Row-count bucket: the next power of two (>= multiple), rounded to ``multiple``,
  so that a run compiles a handful of update programs, not one per step."""
  n = max(n, min_rows, 1)
  b = 1
  while b < n:
    b *= 2
  return round_up(max(b, multiple), multiple)


def left_pad(seqs: Sequence[Sequence[int]], length: int, pad_id: int):
  """Left-pad token lists to ``length`` -> (tokens [N, length], mask [N, length])."""
  n = len(seqs)
  toks = np.full((n, length), pad_id, np.int32)
  mask = np.zeros((n, length), np.int32)
  for i, s in enumerate(seqs):
    s = list(s)[-length:] if length else []
    if s:
      toks[i, length - len(s):] = s
      mask[i, length - len(s):] = 1
  return toks, mask


def make_policy_batch(prompt_tokens: np.ndarray, prompt_mask: np.ndarray,
                      response_tokens: np.ndarray, response_mask: np.ndarray,
                      advantages: np.ndarray, old_logp: np.ndarray,
                      is_offpolicy: np.ndarray, *, num_rows: int,
                      loss_mask: Optional[np.ndarray] = None,
                      pad_id: int = 0) -> PolicyBatch:
  """Concatenate prompt and response and pad the row count to ``num_rows``.

  prompt_*: [n, P]; response_*, old_logp: [n, R]; advantages, is_offpolicy: [n].
  Padding rows have an all-zero loss mask, so they drop out of every denominator.
  """
  n, p = prompt_tokens.shape
  r = response_tokens.shape[1]
  if n > num_rows:
    raise ValueError(f"{n} rows do not fit the bucket of {num_rows}")
  lm = response_mask if loss_mask is None else loss_mask

  def pad(a, fill=0):
    out = np.full((num_rows,) + a.shape[1:], fill, a.dtype)
    out[:n] = a
    return out

  tokens = np.concatenate([prompt_tokens, np.where(response_mask > 0, response_tokens, pad_id)], 1)
  attn = np.concatenate([prompt_mask, response_mask], 1).astype(np.int32)
  tok = pad(tokens.astype(np.int32), pad_id)
  # padding rows still need one attended token so attention never sees an empty row
  tok_mask = pad(attn)
  if num_rows > n:
    tok_mask[n:, p - 1] = 1
  return PolicyBatch(
      tokens=tok,
      attn_mask=tok_mask,
      loss_mask=pad(lm.astype(np.float32)),
      advantages=pad(advantages.astype(np.float32)),
      old_logp=pad(old_logp.astype(np.float32)),
      is_offpolicy=pad(is_offpolicy.astype(bool), False),
  )


def empty_policy_batch(prompt_len: int, response_len: int, num_rows: int) -> PolicyBatch:
  """A batch whose rows are all masked (its loss term is exactly 0)."""
  z = np.zeros((0, prompt_len), np.int32)
  zr = np.zeros((0, response_len), np.int32)
  return make_policy_batch(z, z, zr, zr, np.zeros((0,), np.float32),
                           np.zeros((0, response_len), np.float32), np.zeros((0,), bool),
                           num_rows=num_rows)


def take_rows(batch: PolicyBatch, idx) -> PolicyBatch:
  """Rows ``idx`` of a host batch (e.g. a permutation before mini-batching)."""
  idx = np.asarray(idx)
  return jax.tree.map(lambda a: a if np.ndim(a) == 0 else np.asarray(a)[idx], batch)


def split_rows(batch: PolicyBatch, parts: int) -> list[PolicyBatch]:
  """Split along rows into ``parts`` equal mini-batches (rows must divide)."""
  n = batch.num_rows
  if n % parts:
    raise ValueError(f"{n} rows do not split into {parts} mini-batches")
  k = n // parts
  return [jax.tree.map(lambda a: a[i * k:(i + 1) * k], batch) for i in range(parts)]
