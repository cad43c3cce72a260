"""The one pytree that changes during training, and where it lives on the mesh.

Everything a step changes is in :class:`TrainState`, and the checkpoint saves
it as one: resuming restores exactly the run that was saved, including the
GFPO difficulty history, the stale-params history (``rl.staleness``), the
frozen KL reference and the counters.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import fbos_kernels as K
from fbos_jax import optim as optim_lib
from fbos_jax import sharding as sh
from fbos_jax.model import qwen


@flax.struct.dataclass
class TrainState:
  """Params, optimizer and everything else that changes, as one pytree.

  step:            [] int32   loop steps taken (a skipped non-finite step counts)
  params:          the policy (qwen param pytree)
  opt_state:       optax state (moments in ``optim.opt_state_dtype``)
  rng:             [2] uint32 raw PRNG key data (orbax saves raw arrays)
  nonfinite_steps: [] int32   steps whose loss or gradient was not finite
  gfpo:            AdaptiveKState ring buffer of prompt difficulties, or None
  param_history:   tuple of ``rl.staleness`` older param pytrees (oldest first):
                   the params that sample this step are ``param_history[0]``
  ref_params:      the frozen KL reference (``rl.kl_beta > 0``), or None
  """
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  nonfinite_steps: jax.Array
  gfpo: Optional[Any] = None
  param_history: tuple = ()
  ref_params: Optional[Any] = None

  def sampling_params(self):
    """The params that sample this step: ``rl.staleness`` updates old, or current."""
    return self.param_history[0] if self.param_history else self.params

  def after_sampling(self) -> "TrainState":
    """Shift the stale-params history by one step: drop the oldest, append (a copy
    of) the current params, before the update changes them."""
    if not self.param_history:
      return self
    current = jax.tree.map(jnp.copy, self.params)  # the update donates self.params
    return self.replace(param_history=self.param_history[1:] + (current,))


def param_specs(config, mesh, model_cfg: qwen.ModelConfig, *, strict: bool = False):
  """PartitionSpecs of the params from the config's logical rules."""
  rules = sh.rules_dict(config.mesh.rules)
  abstract = qwen.abstract_params(model_cfg)
  return sh.tree_specs(qwen.param_logical_axes(model_cfg), rules, abstract, mesh, strict=strict)


def like_params(tree, param_tree, param_specs_tree, default):
  """Give every leaf shaped like a param that param's spec (optimizer moments)."""
  by_shape: dict = {}
  for a, s in zip(jax.tree.leaves(param_tree),
                  jax.tree.leaves(param_specs_tree, is_leaf=lambda x: isinstance(x, P))):
    by_shape.setdefault(tuple(a.shape), s)
  return jax.tree.map(lambda a: by_shape.get(tuple(a.shape), default), tree)


def abstract_state(config, mesh, model_cfg: qwen.ModelConfig, optimizer, *,
                   strict: bool = False) -> TrainState:
  """ShapeDtypeStructs, with their shardings on ``mesh``, of the TrainState a
  run of ``config`` holds: the target of init, restore and compiled plans."""
  rl = config.rl
  abstract = qwen.abstract_params(model_cfg)
  specs = param_specs(config, mesh, model_cfg, strict=strict)
  named = lambda s: NamedSharding(mesh, s)
  sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=named(s))
  is_sds = lambda x: isinstance(x, jax.ShapeDtypeStruct)
  params = jax.tree.map(sds, abstract, specs, is_leaf=is_sds)
  opt = jax.eval_shape(lambda p: optim_lib.init_opt_state(optimizer, p, config.optim), abstract)
  opt = jax.tree.map(sds, opt, like_params(opt, abstract, specs, P()), is_leaf=is_sds)
  rep = named(P())
  scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=rep)
  gfpo = None
  if rl.gfpo_adaptive:
    gfpo = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep),
                        jax.eval_shape(lambda: K.adaptive_k_init(rl.gfpo_history)))
  return TrainState(step=scalar(jnp.int32), params=params, opt_state=opt,
                    rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep),
                    nonfinite_steps=scalar(jnp.int32), gfpo=gfpo,
                    param_history=(params,) * int(rl.staleness),
                    ref_params=params if rl.kl_beta > 0 else None)


def state_shardings(abstract: TrainState):
  return jax.tree.map(lambda a: a.sharding, abstract)


def init_state(config, abstract: TrainState, optimizer, params=None) -> TrainState:
  """A fresh TrainState placed as ``abstract`` says: random params (seed
  ``config.seed``) unless ``params`` are given (copied, never donated)."""
  model_cfg = qwen.ModelConfig.from_dict(config.model)
  rl = config.rl

  def build(p):
    if p is None:
      p = qwen.init_params(model_cfg, jax.random.key(config.seed))
    p = jax.tree.map(jnp.copy, p)
    gfpo = K.adaptive_k_init(rl.gfpo_history) if rl.gfpo_adaptive else None
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=p,
        opt_state=optim_lib.init_opt_state(optimizer, p, config.optim),
        rng=jax.random.key_data(jax.random.key(config.seed + 1)),
        nonfinite_steps=jnp.zeros((), jnp.int32), gfpo=gfpo,
        param_history=(p,) * int(rl.staleness), ref_params=p if rl.kl_beta > 0 else None)

  out = state_shardings(abstract)
  if params is None:
    return jax.jit(lambda: build(None), out_shardings=out)()
  return jax.jit(build, out_shardings=out)(params)
