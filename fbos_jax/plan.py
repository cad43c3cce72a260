"""Memory plans without allocation: ``jax.eval_shape`` over the model, optimizer
and KV cache, sharded by the config's rules on a (possibly abstract) mesh."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fbos_jax import sharding as sh
from fbos_jax.model import qwen

GiB = 1024 ** 3

# HBM per chip of common targets, for the "fits" column.
HBM_BYTES = {"v5p": 95 * GiB, "v5e": 16 * GiB, "v4": 32 * GiB, "h100": 80 * GiB,
             "h200": 141 * GiB, "a100": 80 * GiB}


def memory_plan(config, num_devices: int) -> dict[str, Any]:
  """Per-device bytes of params, optimizer state, gradients and KV cache.

  Uses an abstract mesh of ``num_devices`` and ``jax.eval_shape``: nothing is
  allocated, so a 8B model plans on a laptop.
  """
  from fbos_jax.rl.update import make_optimizer

  model_cfg = qwen.ModelConfig.from_dict(config.model)
  mesh = sh.make_abstract_mesh(config.mesh, num_devices)
  rules = sh.rules_dict(config.mesh.rules)
  abstract = qwen.abstract_params(model_cfg)
  logical = qwen.param_logical_axes(model_cfg)
  specs = sh.tree_specs(logical, rules, abstract, mesh, strict=True)
  opt = make_optimizer(config.optim, config.train.steps)
  from fbos_jax.rl.update import init_opt_state
  opt_abstract = jax.eval_shape(lambda p: init_opt_state(opt, p, config.optim), abstract)
  # optimizer moments follow the params' sharding (same shapes); scalars replicated
  opt_specs = _match_specs(opt_abstract, abstract, specs)
  grads = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), abstract)
  batch_shards = sh.batch_shard_count(mesh)
  rows = config.rl.prompts_per_step * max(config.rl.group_size, 1)
  seq = max(config.sampling.prompt_buckets) + config.sampling.max_new_tokens
  cache = jax.eval_shape(lambda: qwen.init_cache(model_cfg, rows, seq))
  axes = qwen.cache_logical_axes()
  cache_specs = qwen.KVCache(*(sh.fit_spec(sh.logical_to_spec(ax, rules), a.shape, mesh)
                               for a, ax in zip(cache, axes)))
  out = {
      "params": sh.per_device_bytes(abstract, specs, mesh),
      "optimizer": sh.per_device_bytes(opt_abstract, opt_specs, mesh),
      "gradients": sh.per_device_bytes(grads, specs, mesh),
      "kv_cache": sh.per_device_bytes(cache, cache_specs, mesh),
  }
  # activations of one update micro-batch with the configured remat: the layer
  # inputs saved for the backward pass, [rows, T, D] per layer (an estimate)
  micro_rows = -(-rows // (batch_shards * max(config.rl.micro_batches, 1)))
  act_bytes = jnp.dtype(model_cfg.compute_dtype).itemsize
  per_layer = micro_rows * seq * model_cfg.hidden_size * act_bytes
  if model_cfg.remat == "none":
    per_layer *= 6 + 3 * model_cfg.intermediate_size // model_cfg.hidden_size
  # plus the one layer being recomputed: its float32 attention scores [rows, H/tp, T, T]
  heads_local = -(-model_cfg.num_heads // mesh.shape["tensor"])
  scores = micro_rows * heads_local * seq * seq * 4
  out["activations"] = model_cfg.num_layers * per_layer + scores
  out["total"] = sum(out.values())
  return {
      "param_count": qwen.count_params(abstract),
      "mesh": dict(mesh.shape),
      "num_devices": num_devices,
      "bytes_per_device": out,
      "kv_rows": rows, "kv_seq": seq, "batch_shards": batch_shards,
      "param_specs": _group_specs(specs),
  }


def _match_specs(opt_abstract, abstract, specs):
  """Give every optimizer leaf shaped like a param that param's spec."""
  from jax.sharding import PartitionSpec as P
  by_shape: dict = {}
  for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
    by_shape.setdefault(tuple(a.shape), s)
  return jax.tree.map(lambda a: by_shape.get(tuple(a.shape), P()), opt_abstract)


def _group_specs(specs) -> dict[str, str]:
  from jax.sharding import PartitionSpec as P
  flat = jax.tree.flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
  return {jax.tree_util.keystr(path, simple=True, separator="/"): str(s) for path, s in flat}


def format_plan(plan: dict, hbm: dict[str, int] | None = None) -> str:
  b = plan["bytes_per_device"]
  lines = [f"params: {plan['param_count']:,}",
           "mesh: " + " x ".join(f"{k}={v}" for k, v in plan["mesh"].items()) +
           f" ({plan['num_devices']} devices)",
           "param sharding:"]
  for name, spec in plan["param_specs"].items():
    lines.append(f"  {name:<22} {spec}")
  lines.append(f"per-device memory (KV cache for {plan['kv_rows']} rows x {plan['kv_seq']} slots):")
  for k in ("params", "optimizer", "gradients", "kv_cache", "activations", "total"):
    lines.append(f"  {k:<10} {b[k] / GiB:8.2f} GiB")
  for name, cap in (hbm or {}).items():
    lines.append(f"  fits {name} ({cap / GiB:.0f} GiB HBM): {'yes' if b['total'] < cap else 'NO'}"
                 f" ({100 * b['total'] / cap:.0f}% used)")
  return "\n".join(lines)
