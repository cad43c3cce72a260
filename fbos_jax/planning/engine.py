"""The engine's programs as abstract (jitted fn, ShapeDtypeStruct args), for
compiled plans (``fbos_jax/planning/programs.py``'s ``compile_program``) and dry runs.

Every program at its largest shapes for the engine config: the decode window
with every slot and staged row of every shard in use and page tables as wide as
the longest row, and the prefill of one chunk for as many prompts as a shard has
slots. The page pool is sized from the config (``EngineConfig.num_pages``, or
the smallest pool that never runs out) and is an argument of both (donated).

    progs = planning.engine.abstract_programs(model_cfg, scfg, ecfg, mesh, rules)
    for name, (fn, args) in progs.items():
      with jax.set_mesh(mesh):
        compiled = fn.lower(*args).compile()
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from fbos_jax import sampling
from fbos_jax import sharding as sh
from fbos_jax.engine import programs
from fbos_jax.engine.runner import Engine
from fbos_jax.engine.types import EngineConfig
from fbos_jax.model import qwen


def abstract_params(cfg: qwen.ModelConfig, mesh, rules):
  """ShapeDtypeStructs of the params the engine reads (the compute copy, in
  ``cfg.compute_dtype``), sharded by the logical rules on ``mesh``."""
  abstract = qwen.abstract_params(cfg)
  rules = rules if isinstance(rules, dict) else sh.rules_dict(rules)
  specs = sh.tree_specs(qwen.param_logical_axes(cfg), rules, abstract, mesh)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, cfg.dtype,
                                                        sharding=NamedSharding(mesh, s)),
                      abstract, specs, is_leaf=lambda x: isinstance(x, P))


def copies_bucket(eng: Engine, n_per_prompt: int) -> int:
  """The prefill's page-copy width for prompts of ``n_per_prompt`` samples: a
  prompt's samples admitted together on one shard (at most slots + staged per
  shard) share its full pages and each but one gets a private copy of its
  partial last page (the runner's bucket; 0 when a prompt has one sample)."""
  most = min(int(n_per_prompt), eng.sps + eng.qs) - 1
  return min(b for b in eng.copies_buckets if b >= most) if most > 0 else 0


def abstract_programs(cfg: qwen.ModelConfig, scfg: sampling.SamplingConfig,
                      ecfg: EngineConfig, mesh, rules=None, *, params=None,
                      logit_bias: bool = False, n_per_prompt: int = 0) -> dict:
  """{"engine_window": (fn, args), "engine_prefill": (fn, args)} at the largest
  shapes (see the module docstring). ``params``: abstract params with shardings
  (default: from the logical ``rules``). ``n_per_prompt``: the samples per prompt
  of the call (sets the prefill's page copies, :func:`copies_bucket`); 0 = as
  many copies as a shard has slots. Also returns, under "engine", the
  :class:`~fbos_jax.engine.Engine` whose programs these are (pool size, buckets)."""
  rules = sh.DEFAULT_RULES if rules is None else rules
  eng = Engine(cfg, scfg, ecfg, mesh=mesh, rules=rules, logit_bias=logit_bias)
  st = eng.st
  params = params if params is not None else abstract_params(cfg, mesh, rules)
  pool_specs = programs.pool_specs(cfg, st, mesh, rules)
  pool = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
      programs.pool_shapes(cfg, st, eng.pages_per_shard), pool_specs,
      is_leaf=lambda x: isinstance(x, P))
  rep = NamedSharding(mesh, P())

  def rows(n, *tail, dtype=jnp.int32):
    shape = (n,) + tail
    spec = sh.fit_spec(sh.batch_spec(len(shape), rules=rules), shape, mesh)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

  def scalar(dtype):
    return jax.ShapeDtypeStruct((), dtype, sharding=rep)

  b = eng.shards * eng.sps
  q = eng.shards * eng.qs
  pb = max(eng.page_buckets)
  stop = jax.ShapeDtypeStruct((sampling.stop_slots(len(scfg.stop_token_ids)),), jnp.int32,
                              sharding=rep)
  fields = lambda n: [rows(n), rows(n), rows(n), rows(n), rows(n, 2, dtype=jnp.uint32),
                      rows(n, dtype=jnp.uint32)]
  window_args = [params, pool] + fields(b) + [rows(b, dtype=jnp.bool_), rows(b, pb)]
  window_args += fields(q) + [rows(q, pb), rows(eng.shards), scalar(jnp.float32),
                              scalar(jnp.float32), stop, scalar(jnp.int32), scalar(jnp.int32)]
  if logit_bias:
    window_args += [rows(b, cfg.vocab_size, dtype=jnp.float32),
                    rows(q, cfg.vocab_size, dtype=jnp.float32)]
  c = max(eng.prefill_buckets)
  ppb = min(pb, -(-eng.max_prompt // st.page_size))
  nc = copies_bucket(eng, n_per_prompt) if n_per_prompt else eng.sps
  prefill_args = [params, pool, rows(b, c), rows(b), rows(b), rows(b, ppb), rows(b),
                  rows(b, nc)]
  return {"engine_window": (eng.program("window"), tuple(window_args)),
          "engine_prefill": (eng.program("prefill"), tuple(prefill_args)),
          "engine": eng}


def describe(eng: Engine) -> dict:
  """The engine shapes a plan compiles, in words and numbers."""
  per_dev = programs.pool_bytes(eng.cfg, eng.st, eng.pages_per_shard) / max(eng.shards, 1)
  kv_split = 1
  if eng.mesh is not None:
    hd = programs.head_entry(eng.mesh, eng.rules, eng.cfg)
    axes = () if hd is None else ((hd,) if isinstance(hd, str) else tuple(hd))
    kv_split = math.prod(eng.mesh.shape[a] for a in axes)
  return {"slots": eng.ecfg.slots, "staged": eng.qs * eng.shards, "batch_shards": eng.shards,
          "page_size": eng.st.page_size, "pages_per_shard": eng.pages_per_shard,
          "pages_per_row": eng.row_pages, "pool_bytes_per_device": per_dev / kv_split,
          "window": eng.st.window, "attention": eng.st.impl,
          "prefill_chunk": max(eng.prefill_buckets)}
