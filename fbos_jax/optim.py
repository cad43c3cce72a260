"""The optimizer, shared by the RL update and the SFT warm start.

State dtype rule: Adam's moments are kept in ``optim.opt_state_dtype``
(float32 by default) whatever the params' dtype, so a bf16 model does not
accumulate its moments in bf16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("constant", "cosine")


def schedule(optim_cfg):
  """The learning rate of update ``k`` (0 = the first): linear warmup over
  ``optim.warmup_steps``, then constant or cosine (to 0.1 x lr) over ``total_steps``.

  optax counts updates from 0 and its warmup schedules start at 0, so used as they
  are, update 0 would train at lr 0 (a whole RL step's rollouts spent on nothing).
  Update k takes the schedule's value at k + 1: the warmup's first nonzero value
  first, the full rate from update ``warmup_steps - 1``. ``warmup_from_zero``
  (the SFT warm start only; :class:`fbos_jax.rl.config.OptimConfig`) keeps optax's
  count."""
  total_steps = int(optim_cfg.total_steps)
  warm = max(int(optim_cfg.warmup_steps), 0)
  lr = float(optim_cfg.learning_rate)
  if optim_cfg.schedule == "cosine":
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(warm, 1), max(total_steps, warm + 1),
                                               end_value=lr * 0.1)
  elif optim_cfg.schedule == "constant":
    sched = optax.join_schedules(
        [optax.linear_schedule(0.0, lr, max(warm, 1)), optax.constant_schedule(lr)], [warm]
    ) if warm else optax.constant_schedule(lr)
  else:
    raise ValueError(f"optim.schedule={optim_cfg.schedule!r}; expected one of {SCHEDULES}.")
  if optim_cfg.warmup_from_zero:
    return sched
  return lambda count: sched(count + 1)


@functools.lru_cache(maxsize=None)
def make_optimizer(optim_cfg) -> optax.GradientTransformation:
  """AdamW on :func:`schedule` with global-norm clipping (``optim.grad_clip``; 0 = off).

  ``optim_cfg``: a :class:`fbos_jax.rl.config.OptimConfig` (frozen): one
  optimizer object per config, so the programs built on it are shared."""
  mu_dtype = jnp.dtype(optim_cfg.opt_state_dtype)
  chain = []
  if optim_cfg.grad_clip and optim_cfg.grad_clip > 0:
    chain.append(optax.clip_by_global_norm(float(optim_cfg.grad_clip)))
  chain.append(optax.adamw(schedule(optim_cfg), b1=optim_cfg.b1, b2=optim_cfg.b2,
                           weight_decay=optim_cfg.weight_decay, mu_dtype=mu_dtype))
  return optax.chain(*chain)


def init_opt_state(optimizer: optax.GradientTransformation, params, optim_cfg):
  """Optimizer state with both Adam moments in ``optim.opt_state_dtype`` (the
  state dtype rule above), whatever the params' dtype."""
  dt = jnp.dtype(optim_cfg.opt_state_dtype)
  return optimizer.init(jax.tree.map(
      lambda p: p.astype(dt) if jnp.issubdtype(p.dtype, jnp.floating) else p, params))
