"""The run's compile set: every program it can call, compiled before its first step.

A run calls a few jitted programs (the static sampler, or the continuous
engine's pool init, decode window and prefill; the update) at the shapes its
buckets pick. Left to the first call in each bucket, their compiles land inside
the RL steps (on a pod one compile stalls every host for minutes). Here the run
enumerates them from the shape model (:mod:`fbos_jax.rl.shapes`; the engine's
:meth:`~fbos_jax.engine.Engine.program_shapes`) and compiles them all before
step 1, lowered with the arguments its own calls pass (the same placement on the
mesh), so those calls find them compiled::

    groups = compile_set.run_programs(ctx, state, eval_prompts=256, eval_k=4)
    report = compile_set.compile_all(groups, progress=True)   # a bar; count, seconds

A compile after that is counted per step (``compile/after_start`` in
metrics.jsonl; :class:`fbos_jax.program_cache.CompileWatch`) and warned about,
naming the program and the shapes of the call (:func:`after_start`).

AReaL's split (``rl.rollout_devices`` / ``rl.max_staleness``): the trainer's set
is its eval and update (``run_programs(..., rounds=False)``); the rollout's
rounds compile on the rollout mesh (:func:`rollout_programs`: the params as the
weight sync places them; the engine streaming the steps): a rollout thread's in
the trainer's set, a rollout process's before its first batch
(``fbos_jax/rl/remote.py``; its compiles after that reach the trainer's metrics
as ``rollout/compile_after_start``).

Not in the set: the helpers' small programs (PRNG splits, a metric's reduction),
compiled on their first call (step 1), and the programs of ``train.probe_every``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import time
import warnings
from typing import Callable

import jax
import numpy as np
from absl import logging

from fbos_jax import sampling as sampling_lib
from fbos_jax import sharding as sh
from fbos_jax.rl import shapes as shapes_lib


@dataclasses.dataclass
class ProgramGroup:
  """The programs of one kind of call: ``shapes`` (one entry per program) and
  ``jobs()``, one thunk per program that lowers and compiles it (independent:
  any order, any thread)."""
  name: str
  shapes: list
  jobs: Callable


def run_programs(ctx, state, *, eval_prompts: int = 0, eval_k: int = 1,
                 rounds: bool = True) -> list:
  """The compile set of the run of ``ctx`` (a :class:`~fbos_jax.rl.context.RolloutContext`
  with its mesh) from ``state`` (a :class:`~fbos_jax.rl.state.TrainState`: the
  params the samplers read, the state the update takes), with the held-out eval
  of ``eval_prompts`` prompts (all processes together; 0 = none) and pass@``eval_k``;
  ``rounds=False``: without the rollout rounds' programs (a split's trainer: its
  rollout compiles :func:`rollout_programs` on its own mesh). A list of
  :class:`ProgramGroup`, nothing compiled yet."""
  from fbos_jax.rl import state as state_lib
  # what the samplers read: the master in model.compute_dtype (state_lib.ComputeCopy)
  params = state_lib.compute_params(state.params, ctx.parts.model)
  groups = sampler_groups(ctx, params, state.rng, eval_prompts=eval_prompts, eval_k=eval_k,
                          rounds=rounds)
  combos = shapes_lib.update_programs(ctx.parts, sh.batch_shard_count(ctx.mesh, ctx.rules),
                                      sampling_lib.mesh_processes(ctx.mesh))
  groups.append(ProgramGroup("update", combos,
                             functools.partial(_update_jobs, ctx, state, combos)))
  return groups


def rollout_programs(ctx, params, rng, *, streamed: bool, recompute: bool = False) -> list:
  """The compile set of an asynchronous run's rollout (``fbos_jax/rl/sources.py``,
  ``fbos_jax/rl/remote.py``): its rounds' programs on its own mesh (``ctx``'s),
  with ``params`` as the weight sync places them there (arrays or
  ShapeDtypeStructs with their shardings) and ``rng`` the run's key as the
  rollout holds it (a host copy). ``streamed``: the rollout streams steps through
  one engine run (round 1 and round 2 under round 2's settings);
  ``recompute``: in-flight weight updates redo the KV cache
  (``rl.inflight_update=recompute``)."""
  return sampler_groups(ctx, params, np.asarray(jax.device_get(rng)), streamed=streamed,
                        recompute=recompute, label="rollout ")


def sampler_groups(ctx, params, rng, *, eval_prompts: int = 0, eval_k: int = 1,
                   rounds: bool = True, streamed=None, recompute: bool = False,
                   label: str = "") -> list:
  """The sampler programs of the calls :func:`fbos_jax.rl.shapes.sampler_calls`
  lists, on ``ctx``'s mesh: the continuous engine's (one group per engine run,
  :func:`fbos_jax.rl.shapes.engine_runs`) or the static sampler's, lowered with
  ``params`` and a key from ``rng`` placed as the calls place them."""
  from fbos_jax.rl import state as state_lib
  parts, mesh, rules = ctx.parts, ctx.mesh, ctx.rules
  kw = dict(eval_prompts=eval_prompts, eval_k=eval_k, rounds=rounds)
  groups = []
  if parts.sampling.engine == "continuous":
    from fbos_jax.engine import Engine
    for names, scfg, n_max in shapes_lib.engine_runs(parts, streamed=streamed, **kw):
      eng = Engine(parts.model, scfg, parts.sampling.engine_config, mesh=mesh, rules=rules)
      progs = eng.program_shapes(n_max, recompute=recompute)
      groups.append(ProgramGroup(f"{label}{' + '.join(names)} (engine)", progs,
                                 functools.partial(eng.compile_jobs, params, progs)))
    return groups
  # the key as a rollout's call passes it (its placement is part of the program)
  key = sampling_lib.sample_key(jax.random.split(state_lib.stream_key(rng, "sample", 0))[0])
  shards = sh.batch_shard_count(mesh, rules)
  for name, (scfg, n, buckets) in shapes_lib.sampler_programs(
      parts, shards, sampling_lib.mesh_processes(mesh), **kw).items():
    groups.append(ProgramGroup(f"{label}{name} (static sampler)", buckets, functools.partial(
        _sampler_jobs, ctx, params, key, scfg, n, buckets)))
  return groups


def _sampler_jobs(ctx, params, key, scfg, n: int, buckets: list) -> list:
  def job(bb, plen):
    fn = sampling_lib.get_generate_fn(ctx.model_cfg, scfg, batch=bb, prompt_len=plen,
                                      n_per_prompt=n, mesh=ctx.mesh, rules=ctx.rules)
    args = sampling_lib.call_args(params, scfg, [], [], bb, plen, key, ctx.mesh, ctx.rules)
    with jax.set_mesh(ctx.mesh):
      fn.lower(*args).compile()
  return [functools.partial(job, bb, plen) for bb, plen in buckets]


def _empty_batch(shape, pad_id: int):
  """A batch of ``shape`` (an UpdateShape: a PolicyBatch; a PackedShape: a
  PackedBatch, packed as the trainer packs) without a sequence."""
  from fbos_jax.rl.batch import make_policy_batch
  r = shape.response_len
  if isinstance(shape, shapes_lib.PackedShape):
    from fbos_jax.rl import packing
    padded = _empty_batch(shapes_lib.UpdateShape(0, shape.seq_len - r, r), pad_id)
    return packing.pack(padded, packing.layout(padded), rows=shape.rows,
                        micro_batches=shape.micro_batches)
  return make_policy_batch([], np.zeros((0, r), np.int32), np.zeros((0, r), np.int32),
                           np.zeros((0,), np.float32), np.zeros((0, r), np.float32),
                           np.zeros((0,), bool), prompt_len=shape.prompt_len,
                           num_rows=shape.rows, loss_mask=np.zeros((0, r), np.float32),
                           pad_id=pad_id)


def _update_jobs(ctx, state, combos: list) -> list:
  from fbos_jax.rl import update as update_lib
  fn = update_lib.compiled_update(ctx.parts, ctx.mesh, ctx.rules)

  def job(combo):
    batches = update_lib.place_batches({k: _empty_batch(s, ctx.pad_id) for k, s in combo.items()},
                                       ctx.mesh, ctx.rules)
    with jax.set_mesh(ctx.mesh):
      fn.lower(state, batches).compile()
  return [functools.partial(job, c) for c in combos]


class CompileSetTooLarge(RuntimeError):
  """The compile set cannot stay loaded in this process (see :class:`MapBudget`)."""


@dataclasses.dataclass
class MapBudget:
  """XLA's CPU backend loads each kernel of a compiled program as its own memory
  mappings (about 100-250 a program), and a process that reaches the kernel's
  ``vm.max_map_count`` (65,530 by default) dies in LLVM with "Cannot allocate
  memory" and a segfault. A compile set keeps every program loaded, so
  :func:`compile_all` projects the count from the programs compiled so far and
  stops with a :class:`CompileSetTooLarge` naming the fields that shrink the set,
  before the process gets there (minutes into the compiles, not at the limit)."""
  start: int
  limit: int
  headroom: float = 0.9     # of the limit, what the set may project to use
  after: int = 8            # programs compiled before a projection is trusted

  @staticmethod
  def count() -> int:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)

  @classmethod
  def here(cls):
    """This process's budget, or None where the kernel has no such limit to read."""
    try:
      with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
      return cls(start=cls.count(), limit=limit)
    except (OSError, ValueError):
      return None

  def projected(self, done: int, total: int) -> int:
    """The maps of all ``total`` programs, at the mean of the ``done`` compiled so far."""
    used = self.count()
    return used + (used - self.start) * (total - done) // max(done, 1)

  def check(self, done: int, total: int):
    if done < min(self.after, total):
      return
    need = self.projected(done, total)
    if need > self.headroom * self.limit:
      raise CompileSetTooLarge(
          f"the compile set's {total} programs would need about {need:,} memory maps after "
          f"{done} of them (XLA's CPU backend maps each kernel), over "
          f"{self.headroom:.0%} of vm.max_map_count={self.limit:,}: the process would die "
          "compiling. Shrink the set: engine.bucket_growth=4 or 0 (fewer row, page and "
          "prefill buckets; `--dry_run` counts them), fewer sampling.*prompt_buckets; or "
          "raise the kernel's limit: sysctl -w vm.max_map_count=262144")


def compile_all(groups: list, *, workers: int = 0, progress: bool = False, say=None) -> dict:
  """Compile every program of ``groups`` on ``workers`` threads (0 = one per
  CPU core, at most 8: XLA compiles outside the GIL; one on a CPU backend), with a progress bar when
  ``progress``. Returns {"programs": count, "seconds": wall time, "groups":
  {name: {"programs": n, "seconds": its programs' compile seconds, summed}}};
  ``say(line)`` gets one line per group and the total. On a CPU backend,
  :class:`CompileSetTooLarge` when the set would not stay loaded
  (:class:`MapBudget`), the programs not yet started cancelled."""
  say = say or (lambda s: None)
  # on a CPU backend one thread: there the programs' devices are these cores, and XLA's
  # CPU compiler segfaulted compiling two of them at once in CI (2 cores, 2 threads)
  workers = int(workers) or (1 if jax.default_backend() == "cpu"
                             else max(1, min(8, os.cpu_count() or 1)))
  total = sum(len(g.shapes) for g in groups)
  out = {"programs": total, "workers": workers, "groups": {}}
  t_all = time.perf_counter()
  jobs = []
  for g in groups:
    out["groups"][g.name] = {"programs": len(g.shapes), "seconds": 0.0}
    jobs += [(g.name, j) for j in g.jobs()]
  bar = None
  if progress:
    from tqdm.auto import tqdm
    bar = tqdm(total=total, desc=f"compile set ({workers} threads)", dynamic_ncols=True)

  def run(name, job):
    t0 = time.perf_counter()
    job()
    return name, time.perf_counter() - t0

  maps = MapBudget.here() if jax.default_backend() == "cpu" else None
  pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile")
  try:  # (the static sampler donates its prompts, aliased only when n == 1: as its calls do)
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
      for done, fut in enumerate(concurrent.futures.as_completed(
          [pool.submit(run, n, j) for n, j in jobs]), 1):
        name, dt = fut.result()
        out["groups"][name]["seconds"] += dt
        if bar is not None:
          bar.update(1)
        if maps is not None:
          maps.check(done, total)
  finally:
    pool.shutdown(wait=True, cancel_futures=True)
    if bar is not None:
      bar.close()
  out["seconds"] = time.perf_counter() - t_all
  for name, g in out["groups"].items():
    say(f"  {name}: {g['programs']} programs ({g['seconds']:.1f} s of compiling)")
  say(f"compile set: {total} programs in {out['seconds']:.1f} s ({workers} threads), "
      "before step 1")
  return out


def after_start(events: list, step: int, first: bool = False) -> dict:
  """The metrics of the compiles ``events`` (:class:`~fbos_jax.program_cache.CompileEvent`)
  of step ``step``, after the compile set: ``compile/after_start`` (count) and
  ``time/compile_after_start_s``; each one warned about, naming the program and
  the shapes of the call that compiled it (on the ``first`` step of the run, a
  helper's small program, compiled on its first call, is only logged)."""
  for e in events:
    log = logging.info if first and not e.call else logging.warning
    log("step %d compiled a program outside the compile set (%.2f s): %s", step, e.seconds,
        e.describe())
  return {"compile/after_start": len(events),
          "time/compile_after_start_s": float(sum(e.seconds for e in events))}
