"""The one pytree that changes during training, where it lives on the mesh, and its PRNG streams.

Everything a step changes is in :class:`TrainState`, and the checkpoint saves
it as one: resuming restores exactly the run that was saved, including the
GFPO difficulty history, the frozen KL reference and the counters.

All randomness of a run comes from ``TrainState.rng`` (seeded from
``config.seed``), through named streams (:func:`stream_key`): ``sample``
(rollout sampling, per step), ``shuffle`` (the update's mini-batch order, per
step), ``eval`` (held-out pass@k, per step), ``sft`` (the warm start), ``init``
(random params), ``data`` (the order of the training prompts, with
``data.shuffle_seed``). Two uses never share a key.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import fbos_kernels as K
from fbos_jax import optim as optim_lib
from fbos_jax import sharding as sh
from fbos_jax.model import qwen

STREAMS = ("sample", "shuffle", "eval", "sft", "init", "data")


def stream_key(rng, name: str, *indices):
  """The PRNG key of stream ``name`` (one of :data:`STREAMS`) of the raw key
  data ``rng`` ([2] uint32, ``TrainState.rng``), folded with ``indices`` (e.g.
  the step). Works traced (inside the update) and on the host."""
  if name not in STREAMS:
    raise ValueError(f"unknown PRNG stream {name!r}; expected one of {STREAMS}")
  key = jax.random.fold_in(jax.random.wrap_key_data(rng), STREAMS.index(name) + 1)
  for i in indices:
    key = jax.random.fold_in(key, i)
  return key


def host_seed(rng, name: str, *indices) -> int:
  """A 31-bit host integer from stream ``name`` (seeds of grain and ``random``)."""
  key = stream_key(rng, name, *indices)
  return int(np.asarray(jax.random.key_data(key)).reshape(-1)[-1]) & 0x7FFFFFFF


def data_seed(seed: int, shuffle_seed: int = 0) -> int:
  """The seed of the training prompts' order (grain): the ``data`` stream of a run
  seeded with ``seed``, at ``data.shuffle_seed``."""
  return host_seed(root_rng(seed), "data", int(shuffle_seed))


def root_rng(seed: int):
  """``TrainState.rng`` of a run seeded with ``seed``: [2] uint32 raw key data."""
  return jax.random.key_data(jax.random.key(int(seed)))


@flax.struct.dataclass
class TrainState:
  """Params, optimizer and everything else that changes, as one pytree.

  step:            [] int32   loop steps taken (a skipped non-finite step counts)
  params:          the policy (qwen param pytree)
  opt_state:       optax state (moments in ``optim.opt_state_dtype``)
  rng:             [2] uint32 raw PRNG key data (orbax saves raw arrays)
  nonfinite_steps: [] int32   steps whose loss or gradient was not finite
  gfpo:            AdaptiveKState ring buffer of prompt difficulties, or None
  ref_params:      the frozen KL reference (``rl.kl_beta > 0``), or None
  """
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  nonfinite_steps: jax.Array
  gfpo: Optional[Any] = None
  ref_params: Optional[Any] = None


# ----------------------------------------------------------------------------- compute copy
# The trained params are a master copy in ``model.param_dtype`` (float32 in every
# shipped config: a bfloat16 master rounds most Adam steps away at lr 1e-6). The
# forward pass casts each weight to ``model.compute_dtype`` where it is used, so the
# update reads the master; the samplers and the engine read a copy in the compute
# dtype, made once per policy version (:class:`ComputeCopy`), half the bytes of an
# f32 master to hold and to send to a rollout mesh.


def needs_compute_copy(model_cfg) -> bool:
  """Whether the samplers read a copy of the params (the master's dtype is not the
  compute dtype)."""
  return jnp.dtype(model_cfg.param_dtype) != jnp.dtype(model_cfg.compute_dtype)


def _to_compute(dtype):
  return lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a


@functools.lru_cache(maxsize=None)
def _cast_fn(dtype_name: str, treedef, shardings: tuple):
  return jax.jit(lambda p: jax.tree.map(_to_compute(jnp.dtype(dtype_name)), p),
                 out_shardings=jax.tree.unflatten(treedef, shardings))


def compute_params(params, model_cfg):
  """``params`` (the master) in ``model_cfg.compute_dtype``, each leaf keeping its
  sharding (one jitted cast); the params themselves when the dtypes agree."""
  if not needs_compute_copy(model_cfg):
    return params
  leaves, treedef = jax.tree.flatten(params)
  fn = _cast_fn(jnp.dtype(model_cfg.compute_dtype).name, treedef,
                tuple(a.sharding for a in leaves))
  return fn(params)


def compute_abstract(abstract, model_cfg):
  """ShapeDtypeStructs (with shardings) of :func:`compute_params` of ``abstract``:
  what the samplers' programs take, for plans."""
  dt = jnp.dtype(model_cfg.compute_dtype)
  return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, dt if jnp.issubdtype(a.dtype, jnp.floating)
                                     else a.dtype, sharding=getattr(a, "sharding", None)),
      abstract, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def check_compute_params(params, model_cfg, who: str = "the sampler"):
  """Raise when ``params`` hold a floating leaf that is not in the compute dtype
  while the master is kept in another (the sampler was handed the master)."""
  if not needs_compute_copy(model_cfg):
    return
  want = jnp.dtype(model_cfg.compute_dtype)
  bad = {jnp.dtype(a.dtype).name for a in jax.tree.leaves(params)
         if jnp.issubdtype(a.dtype, jnp.floating) and jnp.dtype(a.dtype) != want}
  if bad:
    raise TypeError(
        f"{who} was handed params in {', '.join(sorted(bad))} (the master copy, "
        f"model.param_dtype={model_cfg.param_dtype}), but samples in "
        f"model.compute_dtype={model_cfg.compute_dtype}: pass the compute copy "
        "(fbos_jax.rl.state.ComputeCopy, or compute_params(params, model_cfg)), made once "
        "per policy version")


class ComputeCopy:
  """The policy the samplers read: the master params in ``model.compute_dtype``,
  made once per policy version and kept until the next one (``copy(params)``
  returns the kept copy while ``params`` is the same master). With equal dtypes it
  is the master itself. :meth:`release` drops the copy (before an update, so the
  old version's copy does not sit beside the update's memory)."""

  def __init__(self, model_cfg):
    self.model_cfg = model_cfg
    self._source, self._copy = None, None  # a leaf of the master the copy is of
    self.copies = 0  # copies made (one per policy version sampled)

  def __call__(self, params):
    if not needs_compute_copy(self.model_cfg):
      return params
    leaf = jax.tree.leaves(params)[0]
    if self._source is not leaf:
      self._copy = compute_params(params, self.model_cfg)
      self._source = leaf
      self.copies += 1
    return self._copy

  def release(self):
    self._source, self._copy = None, None


def param_specs(parts, mesh, rules, *, strict: bool = False):
  """PartitionSpecs of the params of ``parts.model`` (RunParts or a StateLayout) from
  the logical rules."""
  abstract = qwen.abstract_params(parts.model)
  return sh.tree_specs(qwen.param_logical_axes(parts.model), sh.rules_dict(rules), abstract,
                       mesh, strict=strict)


def like_params(tree, param_tree, param_specs_tree, default):
  """Give every leaf shaped like a param that param's spec (optimizer moments)."""
  by_shape: dict = {}
  for a, s in zip(jax.tree.leaves(param_tree),
                  jax.tree.leaves(param_specs_tree, is_leaf=lambda x: isinstance(x, P))):
    by_shape.setdefault(tuple(a.shape), s)
  return jax.tree.map(lambda a: by_shape.get(tuple(a.shape), default), tree)


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """Which parts a run's :class:`TrainState` holds, and their shapes: the one home
  of the state's optional parts. Built from the run's parts (:meth:`of`); read by
  :func:`abstract_state`, the state builder (:func:`init_state`), the update's
  program key (``fbos_jax/rl/update.py``) and the checkpoint's layout check
  (:meth:`record` is what a checkpoint records, :meth:`differences` what a
  resume compares). Frozen and hashable: runs of one layout share programs.

  model:        the params (and the KL reference's) shapes and dtypes
  optim:        the optimizer (its state's structure: ``optim.grad_clip > 0`` adds
                the clip's empty state, ``optim.opt_state_dtype`` the moments' dtype)
  kl_reference: the state holds ``ref_params``, the frozen KL reference (``rl.kl_beta > 0``)
  gfpo_history: > 0: the state holds ``gfpo``, the adaptive-k ring buffer of this many
                prompt difficulties (``rl.gfpo_adaptive``, ``rl.gfpo_history``); 0: none
  """
  model: qwen.ModelConfig
  optim: Any  # fbos_jax.rl.config.OptimConfig
  kl_reference: bool = False
  gfpo_history: int = 0

  # fields a checkpoint's layout recorded that the state no longer has, with the value
  # that meant "none of it": such a checkpoint resumes, any other value is refused by name
  RETIRED: ClassVar[dict] = {"rl.staleness": 0}  # the simulated stale-params history (issue 31)

  @classmethod
  def of(cls, parts, optim_cfg=None) -> "StateLayout":
    """The layout of a run of ``parts`` (a layout is returned as it is);
    ``optim_cfg`` replaces the run's optimizer (SFT's)."""
    if isinstance(parts, StateLayout):
      return parts if optim_cfg is None else dataclasses.replace(parts, optim=optim_cfg)
    spec = parts.rollout
    return cls(model=parts.model, optim=optim_cfg or parts.optim,
               kl_reference=bool(parts.update.loss.kl_beta > 0),
               gfpo_history=int(spec.gfpo_history) if spec.gfpo_adaptive else 0)

  def record(self) -> dict:
    """The config fields that shape the state besides the model, as a checkpoint's
    meta records them (``"layout"``; the format of every checkpoint written so far)."""
    return {"rl.kl_beta > 0": self.kl_reference,
            "rl.gfpo_adaptive": self.gfpo_history > 0,
            "rl.gfpo_history": self.gfpo_history or None,
            "optim.opt_state_dtype": self.optim.opt_state_dtype,
            "optim.grad_clip > 0": bool(self.optim.grad_clip > 0)}

  def differences(self, saved: Optional[dict]) -> dict:
    """{field: (checkpoint's value, this layout's)} for each recorded field of
    ``saved`` (a checkpoint's ``"layout"``) that differs from :meth:`record`; a
    retired field at its none value (:attr:`RETIRED`) is no difference. Empty for a
    checkpoint written before the layout was recorded (``saved`` None or empty)."""
    if not saved:
      return {}
    want = self.record()
    retired_unused = lambda k: (k not in want and k in self.RETIRED
                                and saved[k] == self.RETIRED[k])
    return {k: (saved.get(k), want.get(k)) for k in set(saved) | set(want)
            if saved.get(k) != want.get(k) and not retired_unused(k)}


def abstract_state(parts, mesh, rules, *, strict: bool = False) -> TrainState:
  """ShapeDtypeStructs, with their shardings on ``mesh``, of the TrainState a
  run of ``parts`` (RunParts, or its :class:`StateLayout`) holds: the target of
  init, restore and compiled plans."""
  lay = StateLayout.of(parts)
  optimizer = optim_lib.make_optimizer(lay.optim)
  abstract = qwen.abstract_params(lay.model)
  specs = param_specs(lay, mesh, rules, strict=strict)
  named = lambda s: NamedSharding(mesh, s)
  sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=named(s))
  is_sds = lambda x: isinstance(x, jax.ShapeDtypeStruct)
  params = jax.tree.map(sds, abstract, specs, is_leaf=is_sds)
  opt = jax.eval_shape(lambda p: optim_lib.init_opt_state(optimizer, p, lay.optim), abstract)
  opt = jax.tree.map(sds, opt, like_params(opt, abstract, specs, P()), is_leaf=is_sds)
  rep = named(P())
  scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=rep)
  gfpo = None
  if lay.gfpo_history:
    gfpo = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep),
                        jax.eval_shape(lambda: K.adaptive_k_init(lay.gfpo_history)))
  return TrainState(step=scalar(jnp.int32), params=params, opt_state=opt,
                    rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep),
                    nonfinite_steps=scalar(jnp.int32), gfpo=gfpo,
                    ref_params=params if lay.kl_reference else None)


def state_shardings(abstract: TrainState):
  return jax.tree.map(lambda a: a.sharding, abstract)


def rules_key(rules) -> tuple:
  """Logical rules as a hashable key (part of cached programs' keys)."""
  return tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                      for k, v in sh.rules_dict(rules).items()))


@functools.lru_cache(maxsize=None)
def _init_fn(layout: StateLayout, mesh, rules: tuple, with_params: bool):
  """The jitted state builder of one layout and mesh (one compile per layout)."""
  out = state_shardings(abstract_state(layout, mesh, dict(rules)))
  optimizer = optim_lib.make_optimizer(layout.optim)

  def build(p, rng):
    if p is None:
      p = qwen.init_params(layout.model, stream_key(rng, "init"))
    p = jax.tree.map(jnp.copy, p)
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=p,
        opt_state=optim_lib.init_opt_state(optimizer, p, layout.optim), rng=rng,
        nonfinite_steps=jnp.zeros((), jnp.int32),
        gfpo=K.adaptive_k_init(layout.gfpo_history) if layout.gfpo_history else None,
        ref_params=p if layout.kl_reference else None)

  if with_params:
    return jax.jit(build, out_shardings=out)
  return jax.jit(lambda rng: build(None, rng), out_shardings=out)


def init_state(parts, mesh, rules, params=None, *, optim_cfg=None, rng=None) -> TrainState:
  """A fresh TrainState on ``mesh``: ``params`` (copied, never donated), else
  random params from the ``init`` stream of ``rng`` (default
  ``root_rng(parts.seed)``; SFT passes its own stream). ``optim_cfg`` replaces
  the run's optimizer (SFT's). The builder is compiled once per state layout and mesh."""
  fn = _init_fn(StateLayout.of(parts, optim_cfg), mesh, rules_key(rules), params is not None)
  rng = root_rng(parts.seed) if rng is None else rng
  return fn(params, rng) if params is not None else fn(rng)


def restore_params(config, workdir: str, *, step: int = -1, mesh=None):
  """The params of checkpoint ``step`` (-1 = latest) of ``workdir``, placed on
  ``mesh`` (default the config's) by the logical rules: no verifier pool, no data
  iterator, no optimizer state. A checkpoint of another model names the field and
  both values. Returns (params, step)."""
  import os
  from fbos_jax import checkpoint as ckpt_lib
  from fbos_jax.rl import config as config_lib
  rules = sh.rules_dict(config.mesh.rules)
  mesh = mesh if mesh is not None else sh.make_mesh(config.mesh)
  model = qwen.ModelConfig.from_dict(config.model)
  parts = config_lib.RunParts(model=model, sampling=None, rollout=None, update=None, optim=None)
  specs = param_specs(parts, mesh, rules)
  abstract = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                        sharding=jax.sharding.NamedSharding(mesh, s)),
      qwen.abstract_params(model), specs, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), save_every=1, keep=1)
  try:
    if ckpt.latest_step() is None:
      raise FileNotFoundError(f"no checkpoint in {ckpt.directory}")
    params, restored, meta = ckpt.restore_params(None if step < 0 else step, abstract,
                                                 {"model": config.model.to_dict()})
  finally:
    ckpt.close()
  warn_other_data(meta.get("config"), config, f"{ckpt.directory}/{restored}")
  return params, restored


# sections whose fields decide what the model was trained on (a difference at eval or
# export is worth a warning); the fields that do not are left out
_DATA_SECTIONS = ("data", "templates")
_DATA_IGNORED = ("data.read_threads",)


def warn_other_data(saved, config, where: str) -> list:
  """Warn (naming each field, both values) when ``config``'s task or data
  (``data.*``, ``templates.*``) differ from those of the run that wrote the
  checkpoint at ``where`` (its meta's config, ``saved``): eval and export then
  read the checkpoint against other data than it trained on. Returns the
  differences as "field: checkpoint=... config=..." strings."""
  import json
  from absl import logging
  from fbos_jax import checkpoint as ckpt_lib
  if not saved:
    return []
  a = ckpt_lib.flatten_fields({k: saved.get(k, {}) for k in _DATA_SECTIONS})
  b = ckpt_lib.flatten_fields(json.loads(json.dumps(
      {k: config[k].to_dict() for k in _DATA_SECTIONS}, default=str)))
  diffs = [f"{f}: checkpoint={a.get(f, '(absent)')!r} config={b.get(f, '(absent)')!r}"
           for f in sorted(set(a) | set(b))
           if f not in _DATA_IGNORED and a.get(f) != b.get(f)]
  if diffs:
    logging.warning("the checkpoint %s was trained on other data than this config names "
                    "(%s); the result is of that checkpoint on this config's data (use the "
                    "run's config if that is not what you meant)", where, "; ".join(diffs))
  return diffs
