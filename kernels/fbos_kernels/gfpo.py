"""GFPO: group filtering with masked baselines, ALGORITHMS.md section 4.

Pipeline: sample a large group G, score each response (:func:`gfpo_scores`),
keep the top k per group (:func:`gfpo_keep_mask`), compute advantages with the
mean and std over the kept subset only (:func:`gfpo_advantages`), and remove
rejected responses from the loss mask (:func:`gfpo_loss_mask`) so token-mean
denominators count kept tokens only (as TRL's GFPO does).

The adaptive-difficulty k (:func:`adaptive_k`) keeps a rolling history of prompt
mean rewards in a pytree (:class:`AdaptiveKState`) that belongs in the
checkpoint.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence, Union

import jax.numpy as jnp

from ._util import as_bool_mask, check_range, check_shape, float_dtype
from .advantages import get_advantage_estimator

__all__ = [
    "gfpo_scores",
    "gfpo_keep_mask",
    "gfpo_advantages",
    "gfpo_loss_mask",
    "AdaptiveKState",
    "adaptive_k_init",
    "adaptive_k",
    "masked_percentile",
    "GFPO_METRICS",
]


def _length_score(rewards, lengths):
  del rewards
  return -jnp.asarray(lengths).astype(jnp.float32)


def _token_efficiency_score(rewards, lengths):
  r = jnp.asarray(rewards).astype(float_dtype(rewards))
  length = jnp.maximum(jnp.asarray(lengths).astype(r.dtype), 1.0)
  return r / length


GFPO_METRICS = {"length": _length_score, "token_efficiency": _token_efficiency_score}


def gfpo_scores(rewards, lengths, metric: Union[str, Callable] = "length"):
  """Retention scores, higher = kept first.

  Args:
    rewards: ``[P, G]`` rewards.
    lengths: ``[P, G]`` response lengths in tokens.
    metric: ``"length"`` (score ``-length``: shortest first),
      ``"token_efficiency"`` (``reward / max(length, 1)``: highest first), or a
      callable ``metric(rewards, lengths) -> scores [P, G]`` (user metric,
      higher = better).

  Returns:
    ``[P, G]`` float scores.
  """
  if callable(metric):
    return jnp.asarray(metric(rewards, lengths))
  try:
    fn = GFPO_METRICS[metric]
  except KeyError:
    raise ValueError(
        f"unknown GFPO metric {metric!r}; valid metric names: {sorted(GFPO_METRICS)} or a callable"
    ) from None
  return fn(rewards, lengths)


def gfpo_keep_mask(scores, valid, k):
  """Top-k retention mask per group.

  Keeps the k highest-scoring *valid* members of each group. Ties are broken
  by index (the lower index wins), so the result is deterministic and equals
  a stable descending sort. NaN scores rank below every finite score.

  Args:
    scores: ``[P, G]`` scores (higher = keep first).
    valid: ``[P, G]`` bool/float validity mask (the shape of ``scores``
      exactly); invalid members are never kept.
    k: python int, scalar, or int array ``[P]`` (per-prompt k, shape
      ``scores.shape[:-1]`` exactly). If a group has fewer than k valid
      members all of them are kept; k <= 0 keeps none.

  Returns:
    ``[P, G]`` bool keep mask (subset of ``valid``).
  """
  s = jnp.asarray(scores)
  check_shape("scores", s.shape, "valid", jnp.shape(valid))
  check_shape("scores", s.shape, "k", jnp.shape(k), allowed=[(), s.shape[:-1]])
  s = jnp.where(jnp.isnan(s), -jnp.inf, s)
  m = as_bool_mask(valid)
  G = s.shape[-1]
  idx = jnp.arange(G)
  si = s[..., :, None]  # candidate i
  sj = s[..., None, :]  # competitor j
  beats = (sj > si) | ((sj == si) & (idx[None, :] < idx[:, None]))
  rank = jnp.sum(beats & m[..., None, :], axis=-1)  # valid members ranked above i
  k = jnp.asarray(k)
  if k.ndim > 0:
    k = k[..., None]
  return m & (rank < k)


def gfpo_advantages(rewards, valid, keep, *, eps: float = 1e-6, estimator: str = "grpo"):
  """GFPO advantages: ``A_i = (r_i - mu_S)/(sigma_S + eps) * m_i``.

  Mean and (unbiased) std are taken over the kept subset S = valid & keep only;
  rejected members get exactly 0. The single-sample / all-equal rules of
  :func:`fbos_kernels.group_advantages` apply to S (|S| < 2 -> 0), and so does
  the non-finite rule: a kept member with a NaN/inf reward is left out of S's
  statistics and gets 0.

  Args:
    rewards, valid, keep: ``[P, G]``, all three the same shape exactly.
    eps: added to the std, >= 0.
    estimator: advantage estimator applied to the kept subset (default "grpo").

  Returns:
    ``[P, G]`` advantages.
  """
  r_shape = jnp.shape(rewards)
  check_shape("rewards", r_shape, "valid", jnp.shape(valid))
  check_shape("rewards", r_shape, "keep", jnp.shape(keep))
  kept = as_bool_mask(valid) & as_bool_mask(keep)
  return get_advantage_estimator(estimator)(rewards, kept, eps=eps)


def gfpo_loss_mask(response_mask, keep):
  """Remove rejected responses' tokens from the loss mask.

  Args:
    response_mask: ``[P, G, T]`` or flattened ``[P*G, T]`` (row ``p*G + g``),
      bool or float.
    keep: ``[P, G]`` keep mask.

  Returns:
    ``response_mask`` with rejected rows zeroed; same shape and dtype.
  """
  rm = jnp.asarray(response_mask)
  kp = as_bool_mask(keep)
  if rm.ndim == kp.ndim + 1 and rm.shape[:-1] == kp.shape:
    k = kp[..., None]
  elif rm.ndim == 2 and rm.shape[0] == kp.size:
    k = kp.reshape(-1)[:, None]
  else:
    raise ValueError(
        f"response_mask shape {rm.shape} matches neither keep {kp.shape} + [T] nor [P*G, T]"
    )
  if rm.dtype == jnp.bool_:
    return rm & k
  return rm * k.astype(rm.dtype)


# --------------------------------------------------------------------------
# Adaptive-difficulty k
# --------------------------------------------------------------------------


class AdaptiveKState(NamedTuple):
  """Rolling history for adaptive-difficulty GFPO (a pytree; checkpoint it).

  Attributes:
    history: ``[H]`` float32 ring buffer of prompt mean rewards.
    count: int32 scalar, total number of values ever pushed; the buffer holds
      ``min(count, H)`` valid values and the next write goes to ``count % H``.
    step: int32 scalar, number of :func:`adaptive_k` calls so far (warm-up).
  """

  history: jnp.ndarray
  count: jnp.ndarray
  step: jnp.ndarray


def adaptive_k_init(history_size: int = 2048) -> AdaptiveKState:
  """Empty adaptive-k state with a ring buffer of ``history_size`` entries."""
  if isinstance(history_size, bool) or not hasattr(history_size, "__index__") or history_size < 1:
    raise ValueError(f"history_size must be an int >= 1, got {history_size!r}")
  history_size = int(history_size)
  return AdaptiveKState(
      history=jnp.zeros((history_size,), jnp.float32),
      count=jnp.zeros((), jnp.int32),
      step=jnp.zeros((), jnp.int32),
  )


def masked_percentile(values, n_valid, q):
  """Percentiles of the valid entries of a buffer (numpy ``method='linear'``).

  Args:
    values: ``[H]`` buffer whose invalid entries are already set to +inf.
    n_valid: int scalar, number of valid (finite) entries (>= 1).
    q: ``[Q]`` percentiles in [0, 100].

  Returns:
    ``[Q]`` float32.
  """
  srt = jnp.sort(values)
  pos = (jnp.asarray(q, jnp.float32) / 100.0) * (jnp.maximum(n_valid, 1) - 1).astype(jnp.float32)
  lo = jnp.floor(pos).astype(jnp.int32)
  hi = jnp.minimum(lo + 1, jnp.maximum(n_valid, 1) - 1)
  frac = pos - lo.astype(jnp.float32)
  vlo, vhi = srt[lo], srt[hi]
  return vlo + (vhi - vlo) * frac


def adaptive_k(
    state: AdaptiveKState,
    group_mean_reward,
    *,
    group_size: int = 16,
    k_map: Sequence[int] = (8, 8, 6, 4),
    warmup_steps: int = 10,
    warmup_k: int = 8,
    valid=None,
):
  """Adaptive-difficulty k per prompt, and the updated rolling history.

  Rule (ALGORITHMS.md section 4): difficulty is the prompt's mean reward. The
  current batch's means are first pushed into the ring buffer, then the 25th,
  50th and 75th percentiles (numpy 'linear' definition) of the buffer's valid
  entries give thresholds p25 <= p50 <= p75 and the bucket is

  * very hard: ``m <= p25``   -> ``k_map[0]`` (8)
  * hard:      ``p25 < m <= p50`` -> ``k_map[1]`` (8)
  * medium:    ``p50 < m <= p75`` -> ``k_map[2]`` (6)
  * easy:      ``m > p75``    -> ``k_map[3]`` (4)

  (ties go to the harder bucket, so zero-reward prompts are never 'easy').
  For the first ``warmup_steps`` calls k = ``warmup_k`` (the history is still
  filled). Every k is clamped to ``[1, group_size - 1]``.

  Args:
    state: :class:`AdaptiveKState`.
    group_mean_reward: ``[P]`` mean reward of each prompt's group.
    group_size: G (>= 2), for the clamp.
    k_map: four ints (very hard, hard, medium, easy).
    warmup_steps: number of initial calls that use ``warmup_k`` (>= 0).
    warmup_k: k during warm-up.
    valid: optional ``[P]`` mask (the shape of ``group_mean_reward``
      exactly); invalid (padding) prompts are not pushed into the history
      (their returned k is still defined).

  Returns:
    ``(k [P] int32, new_state)``.
  """
  if len(k_map) != 4:
    raise ValueError(f"k_map must have 4 entries (very hard, hard, medium, easy), got {k_map!r}")
  check_range("group_size", group_size, ge=2)
  check_range("warmup_steps", warmup_steps, ge=0)
  m = jnp.asarray(group_mean_reward, jnp.float32)
  if m.ndim != 1:
    raise ValueError(f"group_mean_reward must be [P], got shape {m.shape}")
  if valid is not None:
    check_shape("group_mean_reward", m.shape, "valid", jnp.shape(valid))
  P = m.shape[0]
  H = state.history.shape[0]
  if P > H:
    raise ValueError(f"history_size {H} must be >= number of prompts per call {P}")
  v = jnp.ones((P,), bool) if valid is None else as_bool_mask(valid)

  # Push valid means into the ring buffer (invalid ones are dropped).
  offs = jnp.cumsum(v.astype(jnp.int32)) - 1
  pos = jnp.where(v, (state.count + offs) % H, H)  # H = out of bounds -> dropped
  history = state.history.at[pos].set(m, mode="drop")
  count = state.count + jnp.sum(v.astype(jnp.int32))
  n_valid = jnp.minimum(count, H)

  buf = jnp.where(jnp.arange(H) < n_valid, history, jnp.inf)
  p25, p50, p75 = masked_percentile(buf, n_valid, jnp.array([25.0, 50.0, 75.0]))
  bucket = (m > p25).astype(jnp.int32) + (m > p50) + (m > p75)
  k = jnp.asarray(k_map, jnp.int32)[bucket]
  k = jnp.where(state.step < warmup_steps, jnp.int32(warmup_k), k)
  k = jnp.clip(k, 1, max(group_size - 1, 1)).astype(jnp.int32)
  new_state = AdaptiveKState(history=history, count=count, step=state.step + 1)
  return k, new_state
