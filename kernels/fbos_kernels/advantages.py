"""Group-normalised advantages (GRPO family), ALGORITHMS.md section 1.

Rewards come grouped as ``[P, G]`` (prompts x group members) together with a
validity mask of the same shape, because groups can be ragged (e.g. when extra
samples are appended to some groups). All reductions run over the last axis,
so any leading shape ``[..., G]`` works; functions are pure and safe under
``jit``, ``vmap`` and ``grad``.

Conventions (each is also stated in ``kernels/README.md``):

* **std estimator**: the *unbiased* sample std (ddof=1), as verl, TRL and tunix
  use. ``jnp.std`` divides by n and is deliberately not used.
* **eps placement**: ``eps`` is added to the std, ``(r - mean) / (std + eps)``,
  not inside the square root.
* **single-sample groups**: a group with fewer than 2 valid members gets
  advantage 0 (its unbiased std is undefined; verl instead uses std=1).
* **all-equal groups**: advantage exactly 0 (tested with ``==``), even when the
  floating-point mean is not exactly representable.
* **invalid entries**: advantage 0.
* **non-finite rewards** (NaN, +-inf) are invalid members: they are excluded
  from every statistic (count, mean, std, the batch std, the all-equal test)
  and get advantage exactly 0, for every estimator. A batch with one bad reward
  therefore gives every other entry exactly the advantages of the same batch
  with that member marked invalid. (Under ``jit`` a value cannot raise; the
  caller can count them with ``~isfinite(rewards) & valid``.)
* **shapes**: ``valid`` must have the shape of ``rewards`` exactly (a
  broadcastable ``[P, 1]`` raises ``ValueError``); ``eps`` must be >= 0.
"""

from __future__ import annotations

from typing import Callable, Dict

import jax.numpy as jnp

from ._util import as_bool_mask, check_range, check_shape, float_dtype, safe_div, safe_sqrt

__all__ = [
    "group_advantages",
    "grpo_advantages",
    "drgrpo_advantages",
    "batch_std_advantages",
    "group_stats",
    "ADVANTAGE_ESTIMATORS",
    "get_advantage_estimator",
]


def _members(rewards, valid):
  """(rewards in >= float32 with invalid entries set to 0, bool member mask) after the shape check.

  A member is valid and has a finite reward; the ``where`` runs before any
  arithmetic, so NaN/inf rewards touch neither the values nor the gradients.
  """
  r = jnp.asarray(rewards)
  v = jnp.asarray(valid)
  check_shape("rewards", r.shape, "valid", v.shape)
  r = r.astype(float_dtype(r))
  m = as_bool_mask(v) & jnp.isfinite(r)
  return jnp.where(m, r, 0.0), m


def group_stats(rewards, valid):
  """Masked per-group statistics.

  Args:
    rewards: ``[..., G]`` rewards (any real dtype; computed in >= float32).
    valid: ``[..., G]`` bool/float mask, same shape exactly; non-zero = member
      present. Members with a non-finite reward count as invalid.

  Returns:
    dict with ``count [...]`` (float, valid finite members), ``mean [...]``,
    ``std [...]`` (unbiased, 0 where count < 2), ``centered [..., G]``
    (``r - mean`` on valid entries, 0 elsewhere) and ``degenerate [...]``
    (bool: fewer than 2 valid members or all valid rewards equal; such groups
    get advantage 0).
  """
  r0, m = _members(rewards, valid)
  return _stats(r0, m)


def _stats(r0, m):
  dt = r0.dtype
  mf = m.astype(dt)
  n = jnp.sum(mf, axis=-1)
  mean = safe_div(jnp.sum(r0, axis=-1), n)
  centered = jnp.where(m, r0 - mean[..., None], 0.0)
  var = safe_div(jnp.sum(centered * centered, axis=-1), n - 1.0)
  std = safe_sqrt(var)
  big = jnp.asarray(jnp.inf, dt)
  rmax = jnp.max(jnp.where(m, r0, -big), axis=-1)
  rmin = jnp.min(jnp.where(m, r0, big), axis=-1)
  degenerate = (n < 2) | (rmax == rmin)
  return dict(count=n, mean=mean, std=std, centered=centered, degenerate=degenerate)


def grpo_advantages(rewards, valid, *, eps: float = 1e-6):
  """GRPO: ``A = (r - mean_G) / (std_G + eps)``, unbiased std, masked.

  Args:
    rewards: ``[P, G]`` (or ``[..., G]``).
    valid: ``[P, G]`` bool/float mask.
    eps: added to the std (default 1e-6), >= 0.

  Returns:
    ``[P, G]`` advantages; 0 for invalid entries (including non-finite
    rewards), for groups with < 2 valid members and (exactly) for groups
    whose valid rewards are all equal.
  """
  check_range("eps", eps, ge=0)
  s = group_stats(rewards, valid)
  adv = s["centered"] / (s["std"] + eps)[..., None]
  return jnp.where(s["degenerate"][..., None], 0.0, adv)


def drgrpo_advantages(rewards, valid, *, eps: float = 1e-6):
  """Dr.GRPO: ``A = r - mean_G`` (no std). ``eps`` is accepted and unused.

  Shapes, zero rules and the non-finite rule as :func:`grpo_advantages`.
  """
  check_range("eps", eps, ge=0)
  s = group_stats(rewards, valid)
  return jnp.where(s["degenerate"][..., None], 0.0, s["centered"])


def batch_std_advantages(rewards, valid, *, eps: float = 1e-6):
  """TRL ``scale_rewards='batch'``: per-group mean, std over the whole batch.

  ``A = (r - mean_G) / (std_batch + eps)`` where ``std_batch`` is the unbiased
  std of *all* valid rewards in the array (every leading axis pooled). Under
  ``jit`` with a sharded batch this is the global-batch std. Groups with < 2
  valid members or all-equal rewards get 0, as for GRPO. Non-finite rewards
  are invalid members: they are left out of the batch std too, so one NaN
  reward cannot change any other group's advantages.
  """
  check_range("eps", eps, ge=0)
  r0, m = _members(rewards, valid)
  s = _stats(r0, m)
  flat_r = r0.reshape(-1)
  flat_m = m.reshape(-1)
  n = jnp.sum(flat_m.astype(r0.dtype))
  mu = safe_div(jnp.sum(flat_r), n)
  c = jnp.where(flat_m, flat_r - mu, 0.0)
  std = safe_sqrt(safe_div(jnp.sum(c * c), n - 1.0))
  adv = s["centered"] / (std + eps)
  return jnp.where(s["degenerate"][..., None], 0.0, adv)


ADVANTAGE_ESTIMATORS: Dict[str, Callable] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "batch_std": batch_std_advantages,
}


def get_advantage_estimator(name: str) -> Callable:
  """Look up an advantage estimator by name; raises ``ValueError`` listing valid names."""
  try:
    return ADVANTAGE_ESTIMATORS[name]
  except KeyError:
    raise ValueError(
        f"unknown advantage estimator {name!r}; valid names: {sorted(ADVANTAGE_ESTIMATORS)}"
    ) from None


def group_advantages(rewards, valid, *, estimator: str = "grpo", eps: float = 1e-6):
  """Group-normalised advantages.

  Args:
    rewards: ``[P, G]`` rewards (``[..., G]`` also works).
    valid: ``[P, G]`` bool/float validity mask (ragged groups), the shape of
      ``rewards`` exactly.
    estimator: ``"grpo"`` ((r-mean)/(std_unbiased+eps)), ``"drgrpo"`` (r-mean)
      or ``"batch_std"`` (per-group mean, batch-wide unbiased std).
    eps: added to the std, >= 0.

  Returns:
    ``[P, G]`` advantages in >= float32. Invalid entries, non-finite rewards
    (treated as invalid and excluded from every statistic), groups with < 2
    valid members, and all-equal groups give exactly 0.
  """
  return get_advantage_estimator(estimator)(rewards, valid, eps=eps)
