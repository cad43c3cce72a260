"""Plans of a config against hardware it does not own: the programs of a step.

Two kinds, both without allocating anything:

* **Compiled plan** (:func:`compile_plan`, ``launch/train.py --dry_run
  --topology=v5p:2x4x4``): builds the config's mesh over the abstract devices of
  a topology (``fbos_jax/planning/hardware.py``) and compiles every program one step of
  the config runs, at the largest shapes the config can produce, as the
  rollout's own shape model says (``fbos_jax/rl/shapes.py``): round-1 and
  round-2 samplers, the update step (with pi_prox when configured), the eval
  samplers. Each program's per-device memory comes from XLA's
  ``memory_analysis()``; the chip's HBM from the compiler itself. This is the
  authority: a config is done only when every program fits.
* **Abstract plan** (:func:`memory_plan`, ``--dry_run --mesh_devices=N``): the
  per-device bytes of the arrays whose size the shardings decide exactly (no
  compiler, any device count).

FLOPs: XLA's ``cost_analysis()`` counts the body of a ``while``/``scan`` loop
once (checked in ``tests/test_plan.py``), so it undercounts the layer scan,
gradient accumulation and decode loops. The plan therefore prints both: XLA's
figure (per device, loop bodies once) and an analytic count of the whole
program (:func:`fbos_jax.planning.hardware.analytic_flops`), and uses the analytic one
for the roofline.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from fbos_jax.planning import hardware as hw
from fbos_jax import sharding as sh
from fbos_jax.planning.hardware import GiB, PlanError
from fbos_jax.model import qwen
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import shapes as shapes_lib


def plan_parts(config) -> config_lib.RunParts:
  """The run's typed parts as the plan compiles them: no tokenizer here, so one
  stop id stands for EOS (the number of stop ids is compile-time, not the ids)."""
  return config_lib.build_parts(config, eos_id=int(config.model.vocab_size) - 1)


# ----------------------------------------------------------------------------- programs


@dataclasses.dataclass
class Program:
  """One jitted program of a step with abstract arguments, ready to lower."""
  name: str
  fn: Any  # a jax.jit-wrapped function
  args: tuple
  flops: float  # analytic FLOPs of one call, all devices together
  what: str  # one line: the shapes
  knobs: str  # the config fields that shrink it
  refused: str = ""  # why the program cannot be built (the engine refuses its config)
  flops_by_layout: Optional[dict] = None  # update: {"padded", "packed"} analytic FLOPs
  # per-device bytes held while it runs that are not its arguments: during sampling,
  # the train state (the float32 master and Adam's moments) beside the compute copy
  resident: int = 0


def _abstract_batch(shape, mesh, rules):
  """The abstract PolicyBatch of an UpdateShape, or PackedBatch of a PackedShape."""
  from fbos_jax.rl.batch import PackedBatch, PolicyBatch

  def arr(dims, dtype):
    spec = sh.fit_spec(sh.batch_spec(len(dims), rules=rules), dims, mesh)
    return jax.ShapeDtypeStruct(dims, dtype, sharding=NamedSharding(mesh, spec))

  n, t, r = shape.rows, shape.seq_len, shape.response_len
  if isinstance(shape, shapes_lib.PackedShape):
    f32 = lambda: arr((n, t), jnp.float32)
    return PackedBatch(tokens=arr((n, t), jnp.int32), segment_ids=arr((n, t), jnp.int32),
                       loss_mask=f32(), advantages=f32(), old_logp=f32(),
                       is_offpolicy=arr((n, t), jnp.bool_), seq_weight=f32(), response_len=r,
                       micro_batches=shape.micro_batches)
  return PolicyBatch(tokens=arr((n, t), jnp.int32), attn_mask=arr((n, t), jnp.int32),
                     loss_mask=arr((n, r), jnp.float32), advantages=arr((n,), jnp.float32),
                     old_logp=arr((n, r), jnp.float32), is_offpolicy=arr((n,), jnp.bool_))


def _sampler_program(name, shape: shapes_lib.SamplerShape, parts, mesh, rules,
                     params) -> Program:
  from fbos_jax import sampling
  scfg = dataclasses.replace(shape.sampling, prompt_buckets=(shape.prompt_len,))
  scfg.validate(parts.model.vocab_size)
  fn = sampling.get_generate_fn(parts.model, scfg, batch=shape.prompts,
                                prompt_len=shape.prompt_len, n_per_prompt=shape.n, mesh=mesh,
                                rules=rules)
  spec2 = NamedSharding(mesh, sh.batch_spec(2, mesh, shape.prompts, rules=rules))
  spec1 = NamedSharding(mesh, sh.batch_spec(1, mesh, shape.prompts, rules=rules))
  rep = NamedSharding(mesh, P())
  args = (params,
          jax.ShapeDtypeStruct((shape.prompts, shape.prompt_len), jnp.int32, sharding=spec2),
          jax.ShapeDtypeStruct((shape.prompts, shape.prompt_len), jnp.int32, sharding=spec2),
          jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep),
          jax.ShapeDtypeStruct((), jnp.float32, sharding=rep),
          jax.ShapeDtypeStruct((), jnp.float32, sharding=rep),
          jax.ShapeDtypeStruct((sampling.stop_id_array(scfg.stop_token_ids).size,), jnp.int32,
                               sharding=rep),
          jax.ShapeDtypeStruct((shape.prompts,), jnp.int32, sharding=spec1))
  flops = hw.analytic_flops(parts.model, kind="sample", rows=shape.rows, prompts=shape.prompts,
                            prompt_len=shape.prompt_len, response_len=shape.max_new_tokens)
  what = (f"{shape.prompts} prompts x {shape.n} samples, prompt {shape.prompt_len} + "
          f"{shape.max_new_tokens} new tokens" + (" (greedy)" if scfg.is_greedy else ""))
  knobs = ("sampling.batch_buckets (largest = prompts per call), sampling.max_new_tokens, "
           + ("sampling.fap_prompt_buckets / templates.max_prompt_tokens" if "round2" in name
              else "sampling.prompt_buckets") + ", mesh (more fsdp/tensor)")
  return Program(name, fn, args, flops, what, knobs)


ENGINE_KINDS = ("window", "prefill")
_POOL_KNOBS = ("engine.slots, engine.staged (rows prefilled ahead; -1 = as many as slots, "
               "0 = off), engine.num_pages (0 = the smallest pool no row waits on), "
               "engine.page_size, sampling.max_new_tokens, {prompts} / engine.max_prompt_len, "
               "mesh (more fsdp/tensor)")


def _engine_programs(name, shape: shapes_lib.EngineShape, parts, mesh, rules,
                     params) -> list[Program]:
  """The engine's decode window and prefill for call ``name`` at their largest
  shapes (``fbos_jax/planning/engine.py:abstract_programs``), as ``name/window`` and
  ``name/prefill``; both ``refused`` (not built) when the engine refuses its config."""
  from fbos_jax.engine import EngineError
  from fbos_jax.planning import engine as eplan
  prompts = ("sampling.fap_prompt_buckets / templates.max_prompt_tokens" if "round2" in name
             else "sampling.prompt_buckets")
  knobs = _POOL_KNOBS.format(prompts=prompts)
  scfg = shape.sampling
  try:
    scfg.validate(parts.model.vocab_size)
    progs = eplan.abstract_programs(parts.model, scfg, shape.engine, mesh, rules, params=params,
                                    n_per_prompt=shape.n)
  except (EngineError, ValueError) as e:
    return [Program(f"{name}/{k}", None, (), 0.0, "not built: the engine refuses its config",
                    knobs, refused=str(e)) for k in ENGINE_KINDS]
  eng = progs.pop("engine")
  d = eplan.describe(eng)
  pool = (f"pool {d['pages_per_shard']:,} pages of {d['page_size']} per batch shard = "
          f"{d['pool_bytes_per_device'] / GiB:.2f} GiB per device")
  r = shape.max_new_tokens
  greedy = " (greedy)" if scfg.is_greedy else ""
  window_what = (f"{d['slots']} slots + {d['staged']} staged over {d['batch_shards']} batch "
                 f"shard(s), prompt <= {eng.max_prompt} + {r} new tokens ({d['pages_per_row']} "
                 f"pages per row); {pool}; {d['window']}-step window, {d['attention']} "
                 f"attention{greedy}")
  copies = eplan.copies_bucket(eng, shape.n)
  prefill_what = (f"{d['slots']} prompts x one {d['prefill_chunk']}-token chunk into the "
                  f"pages" + (f" (+ {copies} copies of a partial last page for the "
                              f"{shape.n} samples)" if copies else "") + f"; {pool}")
  ctx = eng.max_prompt + r / 2
  flops = {"window": hw.decode_flops(parts.model, d["slots"] * d["window"], ctx),
           "prefill": hw.analytic_flops(parts.model, kind="logprob", rows=d["slots"],
                                        seq=d["prefill_chunk"], response_len=0)}
  what = {"window": window_what, "prefill": prefill_what}
  extra = {"window": "engine.window (steps per call)",
           "prefill": "engine.prefill_chunk (prompt tokens per call)"}
  return [Program(f"{name}/{k}", fn, args, flops[k], what[k], f"{knobs}, {extra[k]}")
          for k, (fn, args) in ((k, progs[f"engine_{k}"]) for k in ENGINE_KINDS)]


def update_flops(parts, batch_shapes: dict) -> float:
  """Analytic FLOPs of one update (all devices) over ``batch_shapes`` ({name:
  UpdateShape or PackedShape}): each term's forward + backward (a packed row's
  attention over its whole causal triangle, its log-probs at every position),
  the frozen reference and pi_prox when configured, every epoch."""
  ucfg = parts.update
  flops = 0.0
  for t in ucfg.terms:
    s = batch_shapes[t.batch]
    kw = dict(rows=s.rows, seq=s.seq_len, response_len=s.scored_len)
    flops += hw.analytic_flops(parts.model, kind="train", remat=parts.model.remat, **kw)
    if ucfg.loss.kl_beta > 0:  # the frozen reference's log-probs
      flops += hw.analytic_flops(parts.model, kind="logprob", **kw)
    if t.loss == "decoupled":  # pi_prox, in the same program
      flops += hw.analytic_flops(parts.model, kind="logprob", **kw)
  return flops * ucfg.epochs


def _update_program(parts, mesh, rules, state, lengths: hw.ResponseLengths) -> Program:
  """The update at its largest shapes (padded, or packed with every sequence at
  its full length), with the analytic FLOPs of both layouts under ``lengths``
  (padded: the largest shapes, which a padded step always computes; packed: the
  sequences the shape model draws, ``rl.micro_batch_tokens`` or the padded
  micro-batch's tokens)."""
  from fbos_jax.rl import update as update_lib
  ucfg = parts.update
  shards = sh.batch_shard_count(mesh, rules)
  padded = shapes_lib.update_shapes(parts, shards)
  modelled = shapes_lib.packed_update_shapes(parts, shards, lengths=lengths)
  flops = {"padded": update_flops(parts, padded), "packed": update_flops(parts, modelled)}
  budget = shapes_lib.micro_batch_budget(parts, shards)
  if ucfg.packed:
    batch_shapes = shapes_lib.packed_update_shapes(parts, shards)
    what = ", ".join(f"{name.upper()} {s.rows} packed rows x {s.seq_len}"
                     for name, s in batch_shapes.items())
    what += (f"; {ucfg.epochs} epoch(s) x {ucfg.mini_batches} mini-batch(es) x micro-batches "
             f"of {budget:,} tokens per batch shard (at most "
             f"{max(s.micro_batches for s in batch_shapes.values())})")
    knobs = ("rl.micro_batch_tokens (fewer = less at once), rl.mini_batches, model.remat, "
             "sampling.max_new_tokens, prompt buckets, mesh (more fsdp)")
  else:
    batch_shapes = padded
    what = ", ".join(f"{name.upper()} {s.rows} rows x ({s.prompt_len} + {s.response_len})"
                     for name, s in batch_shapes.items())
    what += (f"; {ucfg.epochs} epoch(s) x {ucfg.mini_batches} mini-batch(es) x "
             f"{ucfg.micro_batches} micro-batches")
    knobs = ("rl.micro_batches (more = fewer rows at once), rl.mini_batches, model.remat, "
             "rl.prompts_per_step, sampling.max_new_tokens, mesh (more fsdp)")
  jitted = update_lib.compiled_update(parts, mesh, rules)
  batches = {name: _abstract_batch(s, mesh, rules) for name, s in batch_shapes.items()}
  real = sum(s.real_tokens for s in modelled.values())
  flops["packed_budget"], flops["packed_this_run"] = budget, ucfg.packed
  flops["packed_rows"] = {n: (s.rows, s.seq_len, s.micro_batches) for n, s in modelled.items()}
  flops["real_token_frac_padded"] = real / sum(s.rows * s.seq_len for s in padded.values())
  flops["real_token_frac_packed"] = real / sum(s.rows * s.seq_len for s in modelled.values())
  return Program("update", jitted, (state, batches), flops["packed" if ucfg.packed else "padded"],
                 what, knobs, flops_by_layout=flops)


def _wanted(only: Optional[str], name: str) -> bool:
  """``only`` selects a program by its name or, for the engine, by its call."""
  return only is None or only == name or name.startswith(only + "/")


def device_bytes(tree) -> int:
  """Bytes one device holds of the sharded ShapeDtypeStructs ``tree`` (the most any
  device holds of each leaf)."""
  total = 0
  for a in jax.tree.leaves(tree):
    shape = a.sharding.shard_shape(tuple(a.shape)) if a.sharding is not None else a.shape
    total += math.prod(shape) * jnp.dtype(a.dtype).itemsize
  return total


def step_programs(parts, mesh, rules, *, eval_prompts: int = 0, eval_k: int = 1,
                  only: Optional[str] = None, state_resident: bool = True,
                  lengths: hw.ResponseLengths = hw.RESPONSE_LENGTHS) -> list[Program]:
  """Every program one training step (and the periodic eval, ``eval_prompts`` >
  0) of ``parts`` runs, at the shape model's largest shapes (``only``: that one,
  or both engine programs of a call): the static sampler's calls, or with
  ``sampling.engine=continuous`` the engine's window and prefill of each call.

  The samplers take the compute copy of the params (``model.compute_dtype``,
  ``fbos_jax.rl.state.ComputeCopy``); with ``state_resident`` (the state lives on
  the same devices: not the rollout side of a split) the train state they do not
  take (the master, Adam's moments) counts as held beside them."""
  from fbos_jax.rl import state as state_lib
  state = state_lib.abstract_state(parts, mesh, rules, strict=True)
  policy = state_lib.compute_abstract(state.params, parts.model)
  held = 0
  if state_resident:  # the state, less the params when the samplers read the master itself
    held = device_bytes(state) - (0 if state_lib.needs_compute_copy(parts.model)
                                  else device_bytes(state.params))
  shards = sh.batch_shard_count(mesh, rules)
  progs = []
  kw = dict(eval_prompts=eval_prompts, eval_k=eval_k)
  if parts.sampling.engine == "continuous":
    for name, s in shapes_lib.engine_shapes(parts, **kw).items():
      progs += [dataclasses.replace(p, resident=held)
                for p in _engine_programs(name, s, parts, mesh, rules, policy)
                if _wanted(only, p.name)]
  else:
    for name, s in shapes_lib.sampler_shapes(parts, shards, **kw).items():
      if _wanted(only, name):
        progs.append(dataclasses.replace(
            _sampler_program(name, s, parts, mesh, rules, policy), resident=held))
  if _wanted(only, "update"):
    progs.append(_update_program(parts, mesh, rules, state, lengths))
  return progs


# ----------------------------------------------------------------------------- compile


@dataclasses.dataclass
class ProgramReport:
  name: str
  what: str
  knobs: str
  flops: float  # analytic, all devices
  xla_flops: float = float("nan")  # XLA cost_analysis, per device, loop bodies once
  xla_bytes: float = float("nan")
  argument: int = 0
  output: int = 0
  alias: int = 0
  temp: int = 0
  code: int = 0
  error: str = ""  # the compiler's message when it did not compile (or the refusal)
  refused: bool = False  # not built: the engine refused its config (error says why)
  flops_by_layout: Optional[dict] = None  # update: padded and packed FLOPs (Program's)
  resident: int = 0  # held beside it, not an argument (Program.resident)
  seconds: float = 0.0  # lowering + compiling it here

  @property
  def peak(self) -> int:
    """Per-device bytes while the program runs: arguments + outputs that do not
    alias an argument + temporaries + generated code + what is held beside it
    (the train state while a sampler runs)."""
    return self.argument + self.output - self.alias + self.temp + self.code + self.resident


_OOM_RE = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\)")


def compile_program(prog: Program, mesh) -> ProgramReport:
  rep = ProgramReport(prog.name, prog.what, prog.knobs, prog.flops,
                      flops_by_layout=prog.flops_by_layout, resident=prog.resident)
  if prog.refused:
    rep.error, rep.refused = prog.refused, True
    return rep
  t0 = time.perf_counter()
  try:
    with jax.set_mesh(mesh):
      compiled = prog.fn.lower(*prog.args).compile()
    rep.seconds = time.perf_counter() - t0
  except Exception as e:  # noqa: BLE001  (XLA reports OOM as a compile error)
    msg = str(e)
    m = _OOM_RE.search(msg)
    if m:
      unit = {"": 1, "K": 1024, "M": 1024 ** 2, "G": GiB, "T": 1024 ** 4}[m.group(2)]
      rep.temp = int(float(m.group(1)) * unit)
    rep.error = msg.splitlines()[0][:400] if msg else type(e).__name__
    return rep
  ma = compiled.memory_analysis()
  rep.argument = int(ma.argument_size_in_bytes)
  rep.output = int(ma.output_size_in_bytes)
  rep.alias = int(ma.alias_size_in_bytes)
  rep.temp = int(ma.temp_size_in_bytes)
  rep.code = int(ma.generated_code_size_in_bytes)
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  if ca:
    rep.xla_flops = float(ca.get("flops", float("nan")))
    rep.xla_bytes = float(ca.get("bytes accessed", float("nan")))
  return rep


def _fits(rep: ProgramReport, budget: float) -> bool:
  """Compiled, and its peak within ``budget`` bytes (fit fraction x HBM)."""
  return not rep.error and rep.peak <= budget


def _with_update(parts, **changes):
  return dataclasses.replace(parts, update=dataclasses.replace(parts.update, **changes))


def _with_micro_batches(parts, m: int):
  return _with_update(parts, micro_batches=m)


def _with_batch_buckets(parts, buckets: tuple):
  sp = parts.sampling
  r = lambda s: dataclasses.replace(s, batch_buckets=buckets)
  return dataclasses.replace(parts, sampling=config_lib.SamplingParts(
      r(sp.round1), r(sp.round2), r(sp.eval), r(sp.eval_sampled)))


def _micro_batch_options(parts, shards: int) -> list[int]:
  """Larger micro-batch counts that keep rows divisible (at least one row per shard)."""
  rows = min(s.rows for s in shapes_lib.update_shapes(parts, shards).values())
  m = parts.update.micro_batches
  out = []
  while m * 2 <= (rows // shards) * parts.update.micro_batches:
    m *= 2
    out.append(m)
  return out


def compile_plan(config, topology: str, *, search: bool = True,
                 progress: Optional[Callable[[str], None]] = None,
                 lengths: hw.ResponseLengths = hw.RESPONSE_LENGTHS,
                 only: Optional[str] = None) -> dict:
  """Compile every program of one step of ``config`` for ``topology`` and report.

  With ``search``, a program that does not fit is recompiled with larger
  ``rl.micro_batches`` (update), a smaller largest ``sampling.batch_buckets``
  (static samplers) or fewer ``engine.staged`` / ``engine.slots`` (engine
  programs) to find the setting that fits; the report names it. The roofline
  assumes the response lengths ``lengths``. ``only``: compile that program (or
  an engine call's two) alone; the roofline still times every sampler call from
  its shapes, and ``fits`` speaks of the compiled ones."""
  devices = hw.topology_devices(topology)
  mesh = hw.target_mesh(config, devices, topology)
  rules = sh.rules_dict(config.mesh.rules)
  chip = hw.chip_spec(devices[0])
  hbm = hw.hbm_bytes(devices[0])
  frac = hw.fit_fraction(devices[0])
  budget = frac * hbm
  parts = plan_parts(config)
  eval_prompts = config.train.eval_prompts if config.train.eval_every > 0 else 0
  say = progress or (lambda s: None)
  reports: dict[str, ProgramReport] = {}
  suggestions: dict[str, str] = {}
  for prog in step_programs(parts, mesh, rules, eval_prompts=eval_prompts,
                            eval_k=config.train.eval_k, lengths=lengths, only=only):
    say(f"compiling {prog.name}: {prog.what}")
    rep = compile_program(prog, mesh)
    reports[prog.name] = rep
    say(f"  {prog.name}: " + (_failure(rep) if rep.error and not rep.temp else
                              f"peak {(rep.peak if not rep.error else rep.temp) / GiB:.2f} GiB = "
                              f"{100 * (rep.peak if not rep.error else rep.temp) / hbm:.0f}% HBM"))
    if search and not _fits(rep, budget):
      if rep.error and not rep.temp and not rep.refused:  # not about memory: nothing to search
        suggestions[prog.name] = "(no search: the compiler's error is not about memory)"
        continue
      suggestions[prog.name] = _search(parts, mesh, rules, prog.name, budget, say,
                                       eval_prompts, config.train.eval_k)
  shards = sh.batch_shard_count(mesh, rules)
  kw = dict(eval_prompts=eval_prompts, eval_k=config.train.eval_k)
  est = hw.roofline(parts.model, mesh, chip, shapes_lib.sampler_shapes(parts, shards, **kw),
                    reports, engine_shapes=shapes_lib.engine_shapes(parts, **kw),
                    engine=parts.sampling.engine, lengths=lengths)
  model_cfg = parts.model
  processes = len({getattr(d, "process_index", 0) for d in devices})
  cset = compile_set_plan(parts, mesh, rules, reports, processes=processes, **kw)
  return {
      "compile_set": cset,
      "topology": topology, "chip": chip.name, "device_kind": devices[0].device_kind,
      "num_devices": len(devices), "mesh": dict(mesh.shape), "batch_shards": shards,
      "hbm_bytes": hbm, "fit_fraction": frac,
      "dtypes": {"params": model_cfg.param_dtype, "compute": model_cfg.compute_dtype,
                 "optimizer_state": parts.optim.opt_state_dtype,
                 "kv_cache": model_cfg.compute_dtype},
      "attention": model_cfg.attention, "remat": model_cfg.remat,
      "sampler": parts.sampling.engine,
      "param_count": qwen.count_params(qwen.abstract_params(model_cfg)),
      "fits": all(_fits(r, budget) for r in reports.values()),
      "programs": {k: r for k, r in reports.items()},
      "suggestions": suggestions, "roofline": est,
      "est_step_s": est["step_s"],
  }


def compile_set_plan(parts, mesh, rules, reports: dict, *, processes: int = 1,
                     eval_prompts: int = 0, eval_k: int = 1, rounds: bool = True,
                     streamed=None, update: bool = True) -> dict:
  """The run's compile set on ``mesh`` (``fbos_jax/compile_set.py``: every
  program it can call, compiled before step 1), counted from the shape model,
  and its compile time estimated from ``reports`` (each program at its kind's
  largest shape, compiled by the plan on this machine; smaller buckets compile
  about as fast or faster). ``rounds`` / ``streamed``: as
  :func:`fbos_jax.compile_set.sampler_groups`, and ``update=False`` (a split's
  rollout side). Returns
  {"programs": count, "est_seconds": seconds, "groups": {name: {"programs": n,
  "est_seconds": s, "kinds": {kind: n}}}}."""
  from fbos_jax.engine import Engine, EngineError
  shards = sh.batch_shard_count(mesh, rules)
  kw = dict(eval_prompts=eval_prompts, eval_k=eval_k, rounds=rounds)
  secs = lambda name: reports[name].seconds if name in reports else 0.0
  groups = {}
  if parts.sampling.engine == "continuous":
    for names, scfg, n_max in shapes_lib.engine_runs(parts, streamed=streamed, **kw):
      label = " + ".join(names) + " (engine)"
      try:
        eng = Engine(parts.model, scfg, parts.sampling.engine_config, mesh=mesh, rules=rules)
      except (EngineError, ValueError) as e:
        groups[label] = {"programs": 0, "est_seconds": 0.0, "kinds": {}, "refused": str(e)}
        continue
      kinds: dict = {}
      for shape in eng.program_shapes(n_max):
        kinds[shape[0]] = kinds.get(shape[0], 0) + 1
      # names like "rounds (streamed)" are not plan programs: time them by round 2's
      plan_names = [("sample_round2" if "streamed" in n else n) for n in names]
      t = {k: max(secs(f"{n}/{k}") for n in plan_names) for k in ENGINE_KINDS}
      groups[label] = {"programs": sum(kinds.values()), "kinds": kinds,
                       "est_seconds": sum(v * t.get(k, 0.0) for k, v in kinds.items())}
  else:
    for name, (_, _, buckets) in shapes_lib.sampler_programs(parts, shards, processes,
                                                             **kw).items():
      groups[f"{name} (static sampler)"] = {"programs": len(buckets), "kinds": {},
                                            "est_seconds": len(buckets) * secs(name)}
  if update:
    n_update = len(shapes_lib.update_programs(parts, shards, processes))
    groups["update"] = {"programs": n_update, "kinds": {},
                        "est_seconds": n_update * secs("update")}
  return {"programs": sum(g["programs"] for g in groups.values()),
          "est_seconds": sum(g["est_seconds"] for g in groups.values()), "groups": groups}


def format_compile_set(cset: dict) -> list[str]:
  """The plan's lines on the compile set (count and estimated compile time)."""
  lines = [f"compile set (every program the run can call, compiled before step 1): "
           f"{cset['programs']:,} programs, about {cset['est_seconds'] / 60:.1f} min to compile "
           "here (each timed at its kind's largest shape above)"]
  for name, g in cset["groups"].items():
    if g.get("refused"):
      lines.append(f"  {name:<36} refused by the engine: {g['refused']}")
      continue
    kinds = ", ".join(f"{v} {k}" for k, v in g["kinds"].items())
    timed = (f", ~{g['est_seconds']:.0f} s" if g["est_seconds"] or not g["programs"]
             else ", not timed (this plan compiles none of them)")
    lines.append(f"  {name:<36} {g['programs']:>5} programs{' (' + kinds + ')' if kinds else ''}"
                 + timed)
  lines.append("  knobs: engine.bucket_growth (fewer row / page / chunk / copy buckets), "
               "engine.row_buckets / page_buckets / prefill_buckets, sampling.batch_buckets, "
               "the prompt buckets, rl.fixed_row_buckets (padded) or a larger "
               "rl.micro_batch_tokens (packed: fewer micro-batch buckets)")
  return lines


def _search(parts, mesh, rules, name: str, budget: float, say, eval_prompts: int,
            eval_k: int) -> str:
  """The smallest change of one knob that makes program ``name`` fit, as a flag."""
  shards = sh.batch_shard_count(mesh, rules)
  if name == "update" and parts.update.packed:
    budget_now, longest = parts.update.micro_batch_tokens, max(
        s.seq_len for s in shapes_lib.update_shapes(parts, shards).values())
    while budget_now // 2 >= longest:
      budget_now //= 2
      prog = step_programs(_with_update(parts, micro_batch_tokens=budget_now), mesh, rules,
                           only=name)[0]
      say(f"  retry {name} with rl.micro_batch_tokens={budget_now}")
      rep = compile_program(prog, mesh)
      if _fits(rep, budget):
        return f"--config.rl.micro_batch_tokens={budget_now} (peak {rep.peak / GiB:.1f} GiB)"
    return (f"no rl.micro_batch_tokens fits (down to the longest row, {longest} tokens); "
            "shrink the sequence (sampling.max_new_tokens, prompt buckets), use "
            "model.remat='full', or add devices")
  if name == "update":
    for m in _micro_batch_options(parts, shards):
      prog = step_programs(_with_micro_batches(parts, m), mesh, rules, only=name)[0]
      say(f"  retry {name} with rl.micro_batches={m}")
      rep = compile_program(prog, mesh)
      if _fits(rep, budget):
        return f"--config.rl.micro_batches={m} (peak {rep.peak / GiB:.1f} GiB)"
    return ("no rl.micro_batches fits (down to one row per batch shard); shrink the sequence "
            "(sampling.max_new_tokens, prompt buckets), use model.remat='full', or add devices")
  if "/" in name:
    return _search_engine(parts, mesh, rules, name, budget, say, eval_prompts, eval_k)
  if name.startswith(("sample", "eval")):
    buckets = parts.sampling.round1.batch_buckets
    top = max(buckets)
    while top > shards:
      top //= 2
      smaller = tuple(b for b in buckets if b <= top) or (top,)
      progs = step_programs(_with_batch_buckets(parts, smaller), mesh, rules,
                            eval_prompts=eval_prompts, eval_k=eval_k, only=name)
      if not progs:
        break
      say(f"  retry {name} with sampling.batch_buckets up to {top}")
      rep = compile_program(progs[0], mesh)
      if _fits(rep, budget):
        return f"--config.sampling.batch_buckets='{smaller}' (peak {rep.peak / GiB:.1f} GiB)"
    return "no batch bucket fits; shorten prompts / responses or add devices"
  return ""


def _with_engine(parts, **changes):
  ecfg = dataclasses.replace(shapes_lib.engine_config(parts), **changes)
  return dataclasses.replace(parts, sampling=dataclasses.replace(parts.sampling,
                                                                 engine_config=ecfg))


def _engine_options(parts, shards: int) -> list[dict]:
  """Smaller engines to try, in order: fewer staged rows (halved down to none),
  then fewer slots (halved, staged off), each a multiple of the batch shards."""
  e = shapes_lib.engine_config(parts)
  down = lambda n: [m for m in (n // 2 ** i for i in range(1, 12)) if m >= shards
                    and m % shards == 0]
  staged = e.slots if e.staged == -1 else int(e.staged)
  out = [dict(staged=q) for q in down(staged)] + ([dict(staged=0)] if staged else [])
  out += [dict(slots=s, staged=0) for s in down(e.slots)]
  return out


def _search_engine(parts, mesh, rules, name: str, budget: float, say, eval_prompts: int,
                   eval_k: int) -> str:
  """The largest engine (fewest staged rows dropped, then fewest slots) at which
  engine program ``name`` fits; a flag line, or what to change when none does."""
  shards = sh.batch_shard_count(mesh, rules)
  if shapes_lib.engine_config(parts).num_pages:
    return ("engine.num_pages is set: the pool does not shrink with the slots; lower it (or 0 "
            "for the smallest pool that never waits) together with engine.slots / engine.staged")
  for opt in _engine_options(parts, shards):
    progs = step_programs(_with_engine(parts, **opt), mesh, rules, eval_prompts=eval_prompts,
                          eval_k=eval_k, only=name)
    if not progs or progs[0].refused:
      continue
    flags = " ".join(f"--config.engine.{k}={v}" for k, v in opt.items())
    say(f"  retry {name} with {flags}")
    rep = compile_program(progs[0], mesh)
    if _fits(rep, budget):
      return f"{flags} (peak {rep.peak / GiB:.1f} GiB)"
  return ("no engine.slots fits (down to one slot per batch shard, staged off); shorten the "
          "prompts / sampling.max_new_tokens, or add devices")


def fit_micro_batches(config, topology: str, *, progress=None) -> tuple[int, dict]:
  """The fewest ``rl.micro_batches`` (powers of two) at which the update program
  compiles within the fit fraction of HBM on ``topology``: the value a config
  should ship (fewer micro-batches = larger matmuls). Starts at the configured
  count and halves while it fits, or doubles until it does. Returns (count,
  {count: peak bytes, or None when it did not compile}); count 0 if none fits."""
  devices = hw.topology_devices(topology)
  mesh = hw.target_mesh(config, devices, topology)
  rules = sh.rules_dict(config.mesh.rules)
  budget = hw.fit_fraction(devices[0]) * hw.hbm_bytes(devices[0])
  say = progress or (lambda s: None)
  parts = plan_parts(config)
  if parts.update.packed:
    raise PlanError("--fit_micro_batches searches rl.micro_batches of padded rows; with "
                    "rl.micro_batch_tokens the plan itself searches the token budget "
                    "(--dry_run --topology=...)")
  shards = sh.batch_shard_count(mesh, rules)
  rows = min(s.rows for s in shapes_lib.update_shapes(parts, shards).values())
  tried: dict = {}

  def fits(m: int) -> bool:
    prog = step_programs(_with_micro_batches(parts, m), mesh, rules, only="update")[0]
    rep = compile_program(prog, mesh)
    tried[m] = None if rep.error else rep.peak
    say(f"update with rl.micro_batches={m}: "
        + (f"peak {rep.peak / GiB:.2f} GiB" if not rep.error else "does not compile"))
    return _fits(rep, budget)

  m = max(1, 2 ** int(math.log2(max(parts.update.micro_batches, 1))))
  if fits(m):
    while m > 1 and fits(m // 2):
      m //= 2
    return m, tried
  while m * 2 * shards <= rows:
    m *= 2
    if fits(m):
      return m, tried
  return 0, tried


_W = 22  # the program column


def _failure(r: ProgramReport) -> str:
  return ("is refused by the engine: " if r.refused else "does not compile: ") + r.error


def format_compiled_plan(plan: dict) -> str:
  hbm = plan["hbm_bytes"]
  budget = plan["fit_fraction"] * hbm
  d = plan["dtypes"]
  lines = [
      f"topology {plan['topology']}: {plan['num_devices']} x {plan['chip']} "
      f"({plan['device_kind']}), HBM {hbm / GiB:.2f} GiB per device (from the compiler); "
      f"a program fits at <= {plan['fit_fraction']:.0%}",
      "mesh: " + " x ".join(f"{k}={v}" for k, v in plan["mesh"].items()),
      f"params: {plan['param_count']:,} ({d['params']}), compute {d['compute']}, optimizer "
      f"state {d['optimizer_state']}, KV cache {d['kv_cache']}, attention "
      f"{plan['attention']}, remat {plan['remat']}, sampler {plan['sampler']}"
      + (" (the engine's programs: NAME/window, NAME/prefill)"
         if plan["sampler"] == "continuous" else ""),
      "",
      f"{'program':<{_W}} {'args':>8} {'out':>8} {'alias':>8} {'temp':>8} {'code':>6} "
      f"{'state+':>7} {'peak GiB':>9} {'% HBM':>6}  {'FLOPs (analytic)':>16} "
      f"{'XLA FLOPs/dev*':>14}",
  ]
  for name, r in plan["programs"].items():
    g = lambda b: f"{b / GiB:8.2f}"
    if r.error and not r.temp:
      lines.append(f"{name:<{_W}} {_failure(r)}")
      lines.append(f"{'':<{_W}} {r.what}")
      continue
    peak = r.peak if not r.error else r.argument + r.temp + r.resident
    lines.append(f"{name:<{_W}} {g(r.argument)} {g(r.output)} {g(r.alias)} {g(r.temp)} "
                 f"{r.code / GiB:6.2f} {r.resident / GiB:7.2f} {peak / GiB:9.2f} "
                 f"{100 * peak / hbm:5.0f}%  "
                 f"{r.flops:16.3e} {r.xla_flops:14.3e}"
                 + ("" if _fits(r, budget) else "  <-- DOES NOT FIT"))
    lines.append(f"{'':<{_W}} {r.what}")
  lines.append("* XLA's cost_analysis counts a loop body once (layer scan, micro-batches, "
               "decode): per device, a lower bound. The analytic column counts every iteration "
               "(all devices). state+: the train state a sampler does not take but which "
               "stays in HBM beside it (the master params and Adam's moments; the samplers "
               "read the compute copy).")
  for name, r in plan["programs"].items():
    if not _fits(r, budget):
      peak = r.peak if not r.error else r.temp
      if r.error and not r.temp:
        lines.append(f"\n{name} {_failure(r)}")
      else:
        lines.append(f"\n{name} does not fit: {peak / GiB:.2f} GiB > {plan['fit_fraction']:.0%} "
                     f"of {hbm / GiB:.2f} GiB HBM{' (' + r.error + ')' if r.error else ''}.")
      lines.append(f"  knobs that shrink it: {r.knobs}")
      if plan["suggestions"].get(name):
        lines.append(f"  found by recompiling: {plan['suggestions'][name]}")
  lines += [""] + format_roofline(plan["roofline"])
  lines += [""] + format_compile_set(plan["compile_set"])
  lines.append("fits: " + ("yes" if plan["fits"] else "NO"))
  return "\n".join(lines)


def format_roofline(rf: dict) -> list[str]:
  """The roofline's lines: per sampler call the static sampler's and the engine's
  estimates side by side (the one the run uses marked), the update, the step."""
  lines = [f"roofline ({rf['chip']}: {rf['peak_bf16_flops_per_chip'] / 1e12:.0f} TFLOP/s bf16, "
           f"{rf['hbm_bandwidth_per_chip'] / 1e12:.2f} TB/s HBM per chip; lower bounds, "
           "prompts at their largest bucket)"]
  calls = {k: v for k, v in rf.items() if isinstance(v, dict) and "static" in v}
  for model in dict.fromkeys(v["length_model"] for v in calls.values()):
    lines.append(f"  ASSUMED response lengths (not measured; fbos_jax/planning/hardware.py:"
                 f"RESPONSE_LENGTHS): {model}")
  mark = lambda k: " <- this run" if rf["engine"] == k else ""
  for name, v in calls.items():
    st = v["static"]
    lines.append(f"  {name:<14} {v['rows']:,} rows of prompt {v['prompt_len']:,} + up to "
                 f"{v['max_new_tokens']:,} new tokens (mean {v['mean_len']:,.0f})")
    lines.append(f"    static     {st['calls']} call(s) of {st['rows_per_call']:,} rows, each to "
                 f"its longest row (E[max] {st['steps'] / st['calls']:,.0f} steps): prefill "
                 f"{st['prefill_s']:.2f} s + {st['steps']:,.0f} steps x "
                 f"{1e3 * st['step_s']:.2f} ms ({st['bound']}) = {st['total_s']:.2f} s"
                 + mark("static"))
    ct = v.get("continuous")
    if ct:
      lines.append(f"    continuous {ct['slots']:,} slots, refilled as rows stop: "
                   f"{100 * ct['slot_util']:.0f}% slot utilisation, prefill "
                   f"{ct['prefill_s']:.2f} s + {ct['steps']:,.0f} steps x "
                   f"{1e3 * ct['step_s']:.2f} ms ({ct['bound']}) = {ct['total_s']:.2f} s "
                   f"({st['total_s'] / ct['total_s']:.2f}x static)" + mark("continuous"))
  if "update" in rf:
    u = rf["update"]
    lines.append(f"  {'update':<14} {u['total_s']:.2f} s at peak")
    if "padded_s" in u:
      rows = ", ".join(f"{n.upper()} {r:,} x {L:,} in {m} micro-batch(es)"
                       for n, (r, L, m) in u["packed_rows"].items())
      lines.append(f"    padded     {u['padded']:.3e} FLOPs = {u['padded_s']:.2f} s: every row "
                   f"at its prompt bucket + max_new_tokens ({100 * u['real_token_frac_padded']:.0f}"
                   f"% of the positions are real tokens)" + (" <- this run" if not u.get(
                       "packed_this_run") else ""))
      lines.append(f"    packed     {u['packed']:.3e} FLOPs = {u['packed_s']:.2f} s "
                   f"({u['packed_s'] / u['padded_s']:.2f}x): the sequences end to end, "
                   f"micro-batches of {u['packed_budget']:,} tokens per batch shard: {rows} "
                   f"({100 * u['real_token_frac_packed']:.0f}% real; ASSUMED lengths above, FAPs "
                   "= their largest bucket less a response's room + an attempt of those "
                   "lengths)" + (" <- this run" if u.get("packed_this_run") else ""))
  both = (f"static >= {rf['step_s_static']:.2f} s, continuous >= "
          f"{rf['step_s_continuous']:.2f} s" if rf.get("step_s_continuous") else "")
  lines.append(f"  one step (rounds + update, eval excluded): >= {rf['step_s']:.2f} s with the "
               f"{rf['engine']} sampler ({both}); MFU bound {100 * rf['mfu_bound']:.0f}% "
               "(FLOPs of the generated tokens and the update; decode is memory-bound)")
  if rf.get("step_s_by_update"):
    b = rf["step_s_by_update"]
    lines.append(f"  one step with the padded update >= {b['padded']:.2f} s, with the packed "
                 f"update >= {b['packed']:.2f} s")
  lines.append("  assumptions: the response lengths above; a static call decodes every row "
               "until its longest stops; the engine refills a slot the step its row stops "
               "(staged rows), reads only live rows' pages and computes every slot; no host "
               "time, no streaming of round 2 beside round 1")
  return lines


def plan_json(plan: dict) -> dict:
  """The machine-readable summary (the last line of the dry run)."""
  return {"topology": plan["topology"], "hbm_bytes": plan["hbm_bytes"], "fits": plan["fits"],
          "programs": {k: {"peak_bytes": (r.peak if not r.error else None), "flops": r.flops,
                           "xla_flops": r.xla_flops, "temp_bytes": r.temp,
                           "argument_bytes": r.argument, "compile_s": r.seconds}
                       for k, r in plan["programs"].items()},
          "est_step_s": plan["est_step_s"], "mfu_bound": plan["roofline"]["mfu_bound"],
          "update_s": {k: plan["roofline"].get("update", {}).get(f"{k}_s")
                       for k in ("padded", "packed")},
          "est_step_s_by_update": plan["roofline"].get("step_s_by_update"),
          "sampler": plan["sampler"],
          "est_step_s_static": plan["roofline"]["step_s_static"],
          "est_step_s_continuous": plan["roofline"]["step_s_continuous"],
          "suggestions": plan["suggestions"], "dtypes": plan["dtypes"],
          "compile_set": {"programs": plan["compile_set"]["programs"],
                          "est_seconds": plan["compile_set"]["est_seconds"]}}


# ----------------------------------------------------------------------------- abstract plan


def memory_plan(config, num_devices: int) -> dict[str, Any]:
  """Per-device bytes of the arrays whose size the shardings decide exactly:
  params, optimizer state, gradients and the round-1 KV cache, on an abstract
  mesh of ``num_devices`` (``jax.eval_shape``; nothing is allocated, so an 8B
  model plans on a laptop), and the param shardings.

  It does not estimate activations and temporaries: a hand formula was 4-60x
  too low against the compiler's figures (issue 17), so whether a config fits
  is only said by :func:`compile_plan` (``--dry_run --topology=...``)."""
  from fbos_jax.optim import init_opt_state, make_optimizer
  from fbos_jax.rl import state as state_lib

  parts = plan_parts(config)
  model_cfg = parts.model
  mesh = sh.make_abstract_mesh(config.mesh, num_devices)
  rules = sh.rules_dict(config.mesh.rules)
  abstract = qwen.abstract_params(model_cfg)
  logical = qwen.param_logical_axes(model_cfg)
  specs = sh.tree_specs(logical, rules, abstract, mesh, strict=True)
  opt = make_optimizer(parts.optim)
  opt_abstract = jax.eval_shape(lambda p: init_opt_state(opt, p, parts.optim), abstract)
  opt_specs = state_lib.like_params(opt_abstract, abstract, specs, P())
  grads = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), abstract)
  batch_shards = sh.batch_shard_count(mesh, rules)
  round1 = shapes_lib.sampler_shapes(parts, batch_shards)["sample_round1"]
  rows = parts.rollout.prompts_per_step * parts.rollout.group_size
  seq = round1.prompt_len + round1.max_new_tokens
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
  out["total_static"] = sum(out.values())
  return {
      "param_count": qwen.count_params(abstract),
      "mesh": dict(mesh.shape),
      "num_devices": num_devices,
      "bytes_per_device": out,
      "kv_rows": rows, "kv_seq": seq, "batch_shards": batch_shards,
      "param_specs": _group_specs(specs),
  }


def _group_specs(specs) -> dict[str, str]:
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
  lines.append(f"per-device bytes of the sharded arrays (KV cache for {plan['kv_rows']} rows x "
               f"{plan['kv_seq']} slots):")
  for k in ("params", "optimizer", "gradients", "kv_cache", "total_static"):
    lines.append(f"  {k:<12} {b[k] / GiB:8.2f} GiB")
  lines.append("activations and temporaries are not estimated here: whether each program "
               "fits is what `--dry_run --topology=v5p:2x4x4` (XLA's compiler) reports")
  for name, cap in (hbm or {}).items():
    lines.append(f"  the sharded arrays alone take {100 * b['total_static'] / cap:.0f}% of a "
                 f"{name} ({cap / GiB:.2f} GiB HBM)")
  return "\n".join(lines)
