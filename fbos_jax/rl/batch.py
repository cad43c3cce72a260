"""Batches that enter the jitted update step, and the host-side helper that builds them.

A :class:`PolicyBatch` holds N sequences laid out as
``[prompt (left-padded to P) | response (right-padded to R)]``; the hidden state
at index ``P - 1 + j`` predicts response token ``j``.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
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
