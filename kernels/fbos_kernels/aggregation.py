"""Loss aggregation as (sum, denominator) pairs (ALGORITHMS.md section 2).

Every mode returns a pair ``(sum, denom)`` of scalars whose *sums over pieces*
(micro-batches, gradient-accumulation steps, data-parallel shards) equal the
whole-batch pair. Callers add the pairs and divide once with
:func:`safe_divide`, so every mode is exact under any split along the batch
(row) axis, and ``token-mean`` is also exact under splits along time.

For gradient accumulation, the denominator depends only on masks, never on
parameters: compute the total denominator first (or accumulate ``grad(sum)``
over pieces and divide the accumulated gradient by the accumulated
denominator); both give exactly the whole-batch gradient.

Rules:

* **empty rows** (no unmasked token) drop out of every denominator: they add
  0 to the sum and 0 to the row count.
* **all-masked batch**: ``(0, 0)``, and :func:`safe_divide` returns 0 with a
  zero (not NaN) gradient.
* **where before multiply**: masked positions are replaced by 0 with ``where``
  *before* the loss is multiplied by the mask, so NaN/inf in padding leaks into
  neither the value nor the gradient w.r.t. ``loss``. (Arithmetic *upstream* of
  ``aggregate`` is the loss kernels' job: pass them the same ``mask``.)
* **exact shapes**: ``mask`` must have the shape of ``loss`` exactly (a
  broadcastable ``[B, 1]`` raises ``ValueError``); ``mode`` must be one of
  :data:`AGGREGATION_MODES` and ``norm_len`` > 0.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from ._util import check_choice, check_range, check_shape, float_dtype, safe_div

__all__ = ["AGGREGATION_MODES", "aggregate", "aggregate_loss", "safe_divide", "masked_mean", "masked_sum"]

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def safe_divide(total, denom):
  """``total / denom`` where ``denom > 0``, else 0 (finite gradient in both cases)."""
  return safe_div(jnp.asarray(total), jnp.asarray(denom))


def _masked(loss, mask, loss_name="loss"):
  """(loss * mask with masked positions zeroed *before* the multiply, float mask)."""
  loss = jnp.asarray(loss)
  m = jnp.asarray(mask)
  check_shape(loss_name, loss.shape, "mask", m.shape)
  loss = loss.astype(float_dtype(loss))
  mf = m.astype(loss.dtype)
  present = mf != 0
  return jnp.where(present, loss, 0.0) * mf, mf


def aggregate(loss, mask, mode: str = "token-mean", *, norm_len: Optional[float] = None,
              seq_weight=None):
  """Aggregate a per-token loss into an exact ``(sum, denom)`` pair.

  Args:
    loss: ``[B, T]`` per-token loss; NaN/inf at masked positions are ignored
      (value and gradient).
    mask: ``[B, T]`` bool/float loss mask, the shape of ``loss`` exactly
      (float masks act as token weights).
    mode:
      * ``token-mean``: ``(sum_bt l m, sum_bt m)``.
      * ``seq-mean-token-mean``: ``(sum_b rowsum_b / rowcount_b, #nonempty rows)``
        (sum over nonempty rows only).
      * ``seq-mean-token-sum``: ``(sum_b rowsum_b, #nonempty rows)``.
      * ``seq-mean-token-sum-norm`` (Dr.GRPO): ``(sum_b rowsum_b / norm_len,
        #nonempty rows)``, i.e. the mean over sequences of ``rowsum / L`` with
        a constant ``L`` (the max response length). verl divides by ``T``
        only (not by the number of sequences); we follow the Dr.GRPO paper's
        ``1/(G * L_max)`` form.
    norm_len: the constant ``L`` for ``seq-mean-token-sum-norm``; defaults to
      ``T = loss.shape[-1]``; must be > 0. Pass the configured max response
      length so that pieces padded to different ``T`` agree.
    seq_weight: ``[B, T]`` for rows that pack several sequences (None: each row
      is one sequence): at every token, 1 / (the mask's sum over the token's
      sequence), 0 where that sum is 0. The ``seq-*`` modes then reduce per
      sequence instead of per row (``rowsum_b / rowcount_b`` becomes the sum of
      ``l m seq_weight``, the number of nonempty sequences the sum of
      ``m seq_weight``, rounded), so a packed batch gives the pair of the rows it
      packs. ``token-mean`` ignores it.

  Returns:
    ``(sum, denom)`` float scalars. Final loss = ``safe_divide(sum, denom)``.

  Raises:
    ValueError: ``mask`` shape differs from ``loss``; unknown ``mode``;
      ``norm_len <= 0``.
  """
  check_choice("aggregation mode", mode, AGGREGATION_MODES)
  if norm_len is not None:
    check_range("norm_len", norm_len, gt=0)
  lm, mf = _masked(loss, mask)
  if mode == "token-mean":
    return jnp.sum(lm), jnp.sum(mf)
  if seq_weight is not None:
    return _aggregate_sequences(lm, mf, mode, seq_weight, loss.shape[-1] if norm_len is None
                                else norm_len)
  rowsum = jnp.sum(lm, axis=-1)
  rowcount = jnp.sum(mf, axis=-1)
  nonempty = rowcount > 0
  nrows = jnp.sum(nonempty.astype(lm.dtype))
  if mode == "seq-mean-token-mean":
    return jnp.sum(safe_div(rowsum, rowcount)), nrows
  if mode == "seq-mean-token-sum":
    return jnp.sum(rowsum), nrows
  if mode == "seq-mean-token-sum-norm":
    L = loss.shape[-1] if norm_len is None else norm_len
    return jnp.sum(rowsum) / L, nrows
  raise AssertionError(mode)  # unreachable: checked above


def _aggregate_sequences(lm, mf, mode: str, seq_weight, norm_len):
  """The ``seq-*`` pairs of rows packing several sequences (:func:`aggregate`'s
  ``seq_weight``); ``lm``, ``mf``: the masked loss and the float mask."""
  w = jnp.asarray(seq_weight)
  check_shape("loss", lm.shape, "seq_weight", w.shape)
  w = jnp.where(mf != 0, w.astype(lm.dtype), 0.0)
  nseq = jnp.round(jnp.sum(mf * w))  # each nonempty sequence adds 1 (up to rounding)
  if mode == "seq-mean-token-mean":
    return jnp.sum(lm * w), nseq
  if mode == "seq-mean-token-sum":
    return jnp.sum(lm), nseq
  if mode == "seq-mean-token-sum-norm":
    return jnp.sum(lm) / norm_len, nseq
  raise AssertionError(mode)  # unreachable: checked by aggregate


def aggregate_loss(loss, mask, mode: str = "token-mean", *, norm_len: Optional[float] = None):
  """Convenience: ``safe_divide(*aggregate(loss, mask, mode, norm_len=norm_len))`` for one piece."""
  return safe_divide(*aggregate(loss, mask, mode, norm_len=norm_len))


def masked_sum(x, mask, axis=None):
  """``sum(x * mask)`` over ``axis``, ignoring NaN/inf at masked positions; ``mask`` the shape of ``x``."""
  xm, _ = _masked(x, mask, "x")
  return jnp.sum(xm, axis=axis)


def masked_mean(x, mask, axis=None):
  """``sum(x m) / sum(m)`` over ``axis``; 0 (not NaN) where ``sum(m) == 0``; ``mask`` the shape of ``x``."""
  xm, mf = _masked(x, mask, "x")
  return safe_div(jnp.sum(xm, axis=axis), jnp.sum(mf, axis=axis))
