"""Batches that enter the jitted update step, and the host-side helper that builds them.

A :class:`PolicyBatch` holds N sequences laid out as
``[prompt (left-padded to P) | response (right-padded to R)]``; the hidden state
at index ``P - 1 + j`` predicts response token ``j``.

A :class:`PackedBatch` holds the same sequences laid end to end in rows of a
token budget, with segment ids (``fbos_jax/rl/packing.py`` builds it from a
PolicyBatch): the update then trains on real tokens. Both answer the two
questions the objective asks of a batch (:meth:`PolicyBatch.forward_args`,
:meth:`PolicyBatch.scored`), so one objective serves both layouts.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from fbos_jax import buckets


@flax.struct.dataclass
class PolicyBatch:
  """N rows of (prompt, response) with everything the losses need.

  tokens:        [N, P + R] int32   prompt left-padded, response right-padded
  attn_mask:     [N, P + R] int32   1 on real prompt and response tokens
  loss_mask:     [N, R] float32     1 on response tokens that enter the loss
                                    (GFPO-rejected and padding rows are 0)
  advantages:    [N] float32        one advantage per response, broadcast to tokens
  old_logp:      [N, R] float32     log pi_old of each response token as it was
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

  @property
  def seq_weight(self):
    """None: each row is one sequence (see :attr:`PackedBatch.seq_weight`)."""
    return None

  def forward_args(self) -> dict:
    """The model's inputs (``qwen.forward`` keywords)."""
    return dict(tokens=self.tokens, attention_mask=self.attn_mask)

  def scored(self, hidden):
    """(hidden [N, R, D] of the positions that predict the response tokens,
    their targets [N, R]) from the model's hidden [N, P + R, D]."""
    p, r = self.prompt_len, self.response_len
    return hidden[:, p - 1:p - 1 + r], self.tokens[:, p:p + r]


@flax.struct.dataclass
class PackedBatch:
  """A term's sequences laid end to end in N rows of L tokens, with segment ids.

  Every field is per token, at the position that predicts the token it speaks
  of (position t predicts token t + 1), so masks, advantages, log-probs and
  flags follow their tokens::

    tokens:       [N, L] int32    each row's sequences (prompt, then response), then padding
    segment_ids:  [N, L] int32    1, 2, ... for a row's sequences in order, 0 on padding
    loss_mask:    [N, L] float32  at t: the loss mask of token t + 1 (a response token of
                                  the same sequence; 0 elsewhere)
    advantages:   [N, L] float32  the sequence's advantage, at its response positions
    old_logp:     [N, L] float32  log pi_old of token t + 1
    is_offpolicy: [N, L] bool     the sequence's flag
    seq_weight:   [N, L] float32  1 / (the sequence's loss-mask sum) at its response
                                  positions: the seq-* aggregation modes reduce per
                                  sequence (``fbos_kernels.aggregate``)
    response_len: R (static)      the response length of the rows it packs (the
                                  constant of seq-mean-token-sum-norm by default)
    micro_batches: (static)       micro-batches per mini-batch: rows // (mini-batches x
                                  this) rows of the token budget each

  A token attends only to its own sequence, and positions restart at 0 in each
  (``qwen.forward(segment_ids=...)``): every sequence gets the log-probs it
  gets in a PolicyBatch.
  """
  tokens: jax.Array
  segment_ids: jax.Array
  loss_mask: jax.Array
  advantages: jax.Array
  old_logp: jax.Array
  is_offpolicy: jax.Array
  seq_weight: jax.Array
  response_len: int = flax.struct.field(pytree_node=False, default=0)
  micro_batches: int = flax.struct.field(pytree_node=False, default=1)

  @property
  def num_rows(self) -> int:
    return self.tokens.shape[0]

  @property
  def row_len(self) -> int:
    return self.tokens.shape[1]

  def forward_args(self) -> dict:
    return dict(tokens=self.tokens, attention_mask=(self.segment_ids > 0).astype(jnp.int32),
                segment_ids=self.segment_ids)

  def scored(self, hidden):
    """(hidden [N, L, D], targets [N, L]: token t + 1 at position t; the last
    position's target is never in the loss)."""
    return hidden, jnp.roll(self.tokens, -1, axis=1)


def micro_batches(batch, default: int) -> int:
  """Micro-batches per mini-batch of ``batch``: a packed batch's own count (its
  token-budget bucket), else ``default`` (``rl.micro_batches``)."""
  return batch.micro_batches if isinstance(batch, PackedBatch) else int(default)


def make_policy_batch(prompts: list, response_tokens: np.ndarray, response_mask: np.ndarray,
                      advantages: np.ndarray, old_logp: np.ndarray, is_offpolicy: np.ndarray, *,
                      prompt_len: int, num_rows: int, loss_mask: Optional[np.ndarray] = None,
                      pad_id: int = 0, field: str = "") -> PolicyBatch:
  """Left-pad the prompts to ``prompt_len``, append the responses and pad the
  row count to ``num_rows`` with fully masked rows (they drop out of every
  denominator; each keeps one attended token so attention is well defined).

  prompts: n token-id lists; response_*, old_logp, loss_mask: [n, R];
  advantages, is_offpolicy: [n]. ``field`` names the config field of the
  prompt buckets for the error when a prompt is longer than ``prompt_len``.
  """
  n = len(prompts)
  r = response_tokens.shape[1]
  if n > num_rows:
    raise buckets.BucketError(f"{n} rows do not fit the row bucket of {num_rows}")
  pt, pm = buckets.left_pad(prompts, prompt_len, pad_id, rows=num_rows, field=field)
  lm = response_mask if loss_mask is None else loss_mask

  def pad(a, fill=0):
    out = np.full((num_rows,) + a.shape[1:], fill, a.dtype)
    out[:n] = a
    return out

  resp = np.where(response_mask > 0, response_tokens, pad_id).astype(np.int32)
  tokens = np.concatenate([pt, pad(resp.reshape(n, r), pad_id)], 1)
  attn = np.concatenate([pm, pad(np.asarray(response_mask, np.int32).reshape(n, r))], 1)
  return PolicyBatch(
      tokens=tokens, attn_mask=attn,
      loss_mask=pad(np.asarray(lm, np.float32).reshape(n, r)),
      advantages=pad(np.asarray(advantages, np.float32).reshape(n)),
      old_logp=pad(np.asarray(old_logp, np.float32).reshape(n, r)),
      is_offpolicy=pad(np.asarray(is_offpolicy, bool).reshape(n), False))
