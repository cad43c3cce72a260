"""Plans of the asynchronous system (issue 25): the split plan compiled, and the modelled speedup.

* :func:`compile_split_plan`: the devices of a topology split as the run would
  split them (``rl.rollout_devices``, :func:`fbos_jax.rl.split.split_of`),
  the trainer mesh's update program and the rollout mesh's sampler programs
  compiled with :func:`fbos_jax.planning.programs.compile_program` (XLA's memory analysis is
  the authority), and the weight sync planned as it runs
  (:class:`fbos_jax.rl.weight_sync.WeightSync`: the intermediate mesh and its
  shard-by-shard cover, checked): its bytes and an interconnect-time estimate.
  A side fits when its largest program plus what the asynchronous loop adds
  (rollout: the arriving copy of the params; trainer: one sync chunk's
  intermediate shards) stays within the fit fraction of HBM.
* :func:`modelled_speedup`: step times from the roofline of the compiled plan's
  programs (``fbos_jax.planning.hardware.roofline``: analytic FLOPs at the bf16 peak,
  decode at HBM bandwidth; lower bounds), synchronous on all devices against
  asynchronous on the split, at steady state with eta >= 1:
  ``sync = rollout(all) + train(all)``, ``async = max(rollout(N), train(rest) + sync)``.
* :func:`split_model`: the faithful model (issue 31): every split of whole hosts
  and every rollout mesh; the rollout drained and never drained (continuous
  generation) through the slots that fit; each decode step at an ASSUMED fixed
  cost (``hardware.ASSUMED_DECODE_STEP_FIXED_S``) + its HBM reads, FLOPs and FSDP
  weight gathers; the update padded and packed; the rollout mesh chosen for decode
  (fewest weight bytes moved per chip per step) and the best split.

The interconnect figures (:data:`ICI_BYTES_PER_S`) are public per-chip totals;
the estimate takes half of them (one direction) for a device's received shard.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax

from fbos_jax.planning import hardware as hw
from fbos_jax.planning import programs as plan_lib
from fbos_jax import sharding as sh
from fbos_jax.engine.types import EngineError
from fbos_jax.rl import split as split_lib
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import shapes as shapes_lib
from fbos_jax.rl import sources
from fbos_jax.rl import state as state_lib
from fbos_jax.rl import weight_sync

GiB = hw.GiB
# Chip-to-chip bandwidth per chip, all links, both directions (bytes/s). Sources:
# Google Cloud TPU system-architecture pages (ICI: v4 2,400 Gbps, v5e 1,600 Gbps,
# v5p 4,800 Gbps, v6e 3,584 Gbps per chip); NVIDIA H100 SXM NVLink 900 GB/s.
ICI_BYTES_PER_S = {"TPU v4": 2400e9 / 8, "TPU v5e": 1600e9 / 8, "TPU v5p": 4800e9 / 8,
                   "TPU v6e": 3584e9 / 8, "NVIDIA H100 SXM": 900e9, "NVIDIA H200 SXM": 900e9}


# ASSUMED: a host's network for the transfer server between paired hosts (a
# multi-process split's weights cross host to host, not over ICI): 100 Gb/s.
DCN_BYTES_PER_S_PER_HOST = 100e9 / 8


@dataclasses.dataclass
class SplitMeshes:
  trainer: jax.sharding.Mesh
  rollout: jax.sharding.Mesh
  rules: dict


def split_meshes(config, devices, rollout_devices: int,
                 rollout_mesh: Optional[tuple] = None) -> SplitMeshes:
  """The two meshes of ``rollout_devices`` on ``devices`` (as the run splits them:
  in one process, or whole processes per side, ``fbos_jax.rl.split.split_of``);
  the rollout mesh's axes ``rollout_mesh`` (((axis, size), ...); default the
  config's ``rl.rollout_mesh``)."""
  if rollout_mesh is None:
    rollout_mesh = config_lib.async_config(config).rollout_mesh
  rollout_cfg = split_lib.rollout_mesh_config(config.mesh, rollout_mesh)
  trainer, rollout = split_lib.split_of(devices, rollout_devices, config.mesh, rollout_cfg)
  return SplitMeshes(hw.target_mesh(config, trainer), sh.make_mesh(rollout_cfg, rollout),
                     sh.rules_dict(config.mesh.rules))


def plan_sync(parts, meshes: SplitMeshes, chunk_bytes: int, chip) -> dict:
  """The weight sync of ``parts``'s compute copy (``model.compute_dtype``, what the
  rollout samples with; never the float32 master) from the trainer to the rollout
  mesh as the run makes it: in one process,
  :class:`~fbos_jax.rl.weight_sync.WeightSync` (its intermediate mesh and cover
  checked; interconnect estimate over ICI); over processes, one jitted copy onto
  the trainer's devices laid out as the rollout's, pulled by JAX's transfer server
  between paired hosts (estimate over the hosts' network at the ASSUMED
  :data:`DCN_BYTES_PER_S_PER_HOST`)."""
  st = state_lib.abstract_state(parts, meshes.trainer, meshes.rules)
  policy = state_lib.compute_abstract(st.params, parts.model)
  specs = state_lib.param_specs(parts, meshes.rollout, meshes.rules)
  dst = weight_sync.rollout_shardings(policy, specs, meshes.rollout)
  total, most = weight_sync.received_bytes(policy, dst)
  hosts = len({d.process_index for d in meshes.rollout.devices.flat})
  same = dict(meshes.trainer.shape) == dict(meshes.rollout.shape)
  if {d.process_index for d in meshes.rollout.devices.flat} & {
      d.process_index for d in meshes.trainer.devices.flat}:
    ws = weight_sync.WeightSync(policy, dst, chunk_bytes, "split")
    bw = ICI_BYTES_PER_S.get(chip.name, 0.0) / 2  # one direction
    return {"path": "device-to-device (one process)", "bytes_total": total,
            "bytes_per_device_max": most, "chunks": len(ws.groups),
            "largest_chunk_bytes": max(ws.group_bytes),
            "intermediate_bytes_per_device": max(ws.group_bytes) / meshes.trainer.size,
            "bytes_per_s": bw, "est_s": most / bw if bw else float("nan"), "same_shape": same}
  per_host = total / hosts
  return {"path": "transfer server (paired hosts)", "bytes_total": total,
          "bytes_per_device_max": most, "chunks": 1, "largest_chunk_bytes": total,
          "intermediate_bytes_per_device": most, "bytes_per_s": DCN_BYTES_PER_S_PER_HOST,
          "est_s": per_host / DCN_BYTES_PER_S_PER_HOST, "same_shape": same}


def _programs(parts, mesh, rules, names, eval_prompts=0, eval_k=1, state_resident=False):
  """The step's programs of the calls ``names`` (a sampler call on the continuous
  engine is two programs, ``NAME/window`` and ``NAME/prefill``). The rollout side
  of a split does not hold the train state; the trainer's eval samples beside it."""
  return [p for p in plan_lib.step_programs(parts, mesh, rules, eval_prompts=eval_prompts,
                                            eval_k=eval_k, state_resident=state_resident)
          if p.name.split("/")[0] in names]


def _trainer_calls(config) -> tuple:
  """The trainer side's programs: the update, and the periodic eval's samplers."""
  if config.train.eval_every <= 0 or config.train.eval_prompts <= 0:
    return ("update",)
  return ("update", "eval_greedy") + (("eval_sampled",) if config.train.eval_k > 1 else ())


def compile_split_plan(config, topology: str, rollout_devices: int, *,
                       chunk_bytes: int = 512 * 2 ** 20,
                       progress: Optional[Callable[[str], None]] = None) -> dict:
  """Compile the split plan of ``config`` on ``topology``: the update and the
  periodic eval's samplers (beside the train state) on the trainer mesh, the
  rollout samplers on the rollout mesh, the sync planned; every side checked to
  fit (with the numbers; ``fits`` False otherwise)."""
  say = progress or (lambda s: None)
  devices = hw.topology_devices(topology)
  meshes = split_meshes(config, devices, rollout_devices)
  chip = hw.chip_spec(devices[0])
  hbm, frac = hw.hbm_bytes(devices[0]), hw.fit_fraction(devices[0])
  parts = plan_lib.plan_parts(config)
  samplers = tuple(shapes_lib.sampler_shapes(parts, sh.batch_shard_count(meshes.rollout,
                                                                         meshes.rules)))
  reports, suggestions = {}, {}
  evals = config.train.eval_prompts if config.train.eval_every > 0 else 0
  for side, mesh, names in (("trainer", meshes.trainer, _trainer_calls(config)),
                            ("rollout", meshes.rollout, samplers)):
    trainer = side == "trainer"
    progs = _programs(parts, mesh, meshes.rules, names, eval_prompts=evals if trainer else 0,
                      eval_k=config.train.eval_k, state_resident=trainer)
    if not progs:  # a side without programs would "fit" with 0 bytes
      raise RuntimeError(f"split plan: no program of the {side} side ({', '.join(names)}) "
                         f"among the step's programs")
    for prog in progs:
      say(f"compiling {side}/{prog.name}: {prog.what}")
      reports[f"{side}/{prog.name}"] = plan_lib.compile_program(prog, mesh)
  upd = reports["trainer/update"]
  if upd.error or upd.peak > frac * hbm:  # the trainer has fewer chips: more micro-batches
    found = _fit_update(parts, meshes, frac * hbm, say)
    if found:
      reports["trainer/update"], m = found
      suggestions["trainer/update"] = f"--config.rl.micro_batches={m}"
  sync = plan_sync(parts, meshes, chunk_bytes, chip)
  params_rollout = split_lib.split_bytes(parts, meshes.trainer, meshes.rollout,
                                        meshes.rules)["rollout"] // 2
  peaks = {}
  for side, extra in (("trainer", sync["intermediate_bytes_per_device"]),
                      ("rollout", params_rollout)):
    progs = [r for k, r in reports.items() if k.startswith(side)]
    bad = [r for r in progs if r.error]
    peak = max((r.peak for r in progs if not r.error), default=0)
    peaks[side] = {"largest_program": peak, "async_extra": int(extra),
                   "peak": int(peak + extra), "errors": [r.name for r in bad]}
  fits = all(not p["errors"] and p["peak"] <= frac * hbm for p in peaks.values())
  return {"compile_set": split_compile_sets(config, parts, meshes, reports),
          "topology": topology, "chip": chip.name, "hbm_bytes": hbm, "fit_fraction": frac,
          "rollout_devices": rollout_devices, "trainer_devices": meshes.trainer.size,
          "meshes": {"trainer": dict(meshes.trainer.shape), "rollout": dict(meshes.rollout.shape)},
          "programs": reports, "sides": peaks, "sync": sync, "fits": fits,
          "suggestions": suggestions}


def split_compile_sets(config, parts, meshes: SplitMeshes, reports: dict) -> dict:
  """Each side's compile set (``fbos_jax/compile_set.py``, counted as
  :func:`fbos_jax.planning.programs.compile_set_plan` counts it): the rollout's
  rounds (one rollout process streams the steps through one engine run; several
  sample step by step, ``fbos_jax/rl/remote.py``), the trainer's eval and update."""
  procs = lambda mesh: len({getattr(d, "process_index", 0) for d in mesh.devices.flat})
  timed = lambda side: {k.split("/", 1)[1]: r for k, r in reports.items()
                        if k.startswith(side + "/")}
  pr = procs(meshes.rollout)
  streamed = sources.streams_steps(parts, pr) or None
  evals = config.train.eval_prompts if config.train.eval_every > 0 else 0
  return {"rollout": plan_lib.compile_set_plan(parts, meshes.rollout, meshes.rules,
                                               timed("rollout"), processes=pr,
                                               streamed=streamed, update=False),
          "trainer": plan_lib.compile_set_plan(parts, meshes.trainer, meshes.rules,
                                               timed("trainer"), processes=procs(meshes.trainer),
                                               eval_prompts=evals, eval_k=config.train.eval_k,
                                               rounds=False)}


def _fit_update(parts, meshes: SplitMeshes, budget: float, say):
  """(report, micro-batches) of the fewest ``rl.micro_batches`` (doubling) at which
  the update fits the trainer mesh, or None."""
  shards = sh.batch_shard_count(meshes.trainer, meshes.rules)
  for m in plan_lib._micro_batch_options(parts, shards):  # pylint: disable=protected-access
    p = plan_lib._with_micro_batches(parts, m)  # pylint: disable=protected-access
    prog = plan_lib.step_programs(p, meshes.trainer, meshes.rules, only="update")[0]
    say(f"  retry trainer/update with rl.micro_batches={m}")
    rep = plan_lib.compile_program(prog, meshes.trainer)
    if not rep.error and rep.peak <= budget:
      return rep, m
  return None


def format_split_plan(plan: dict) -> str:
  hbm = plan["hbm_bytes"]
  g = lambda b: f"{b / GiB:.2f} GiB"
  lines = [f"split plan on {plan['topology']} ({plan['chip']}, {g(hbm)} HBM per device, fits at "
           f"<= {plan['fit_fraction']:.0%}): rollout {plan['rollout_devices']} devices "
           f"{plan['meshes']['rollout']}, trainer {plan['trainer_devices']} devices "
           f"{plan['meshes']['trainer']}"]
  for name, r in plan["programs"].items():
    lines.append(f"  {name:<24} " + (f"does not compile: {r.error}" if r.error else
                                     f"peak {g(r.peak)} ({100 * r.peak / hbm:.0f}% HBM); {r.what}"))
  for side, p in plan["sides"].items():
    extra = "the arriving params copy" if side == "rollout" else "one sync chunk's intermediate"
    lines.append(f"  {side} side: largest program {g(p['largest_program'])} + {extra} "
                 f"{g(p['async_extra'])} = {g(p['peak'])} ({100 * p['peak'] / hbm:.1f}% of HBM, "
                 f"headroom {100 * (1 - p['peak'] / hbm):.1f}%)")
  s = plan["sync"]
  lines.append(f"  weight sync ({s['path']}): {s['bytes_total'] / 1e9:.2f} GB received in all "
               f"({s['bytes_per_device_max'] / 1e9:.3f} GB the most one device), {s['chunks']} "
               f"chunk(s) (the largest {s['largest_chunk_bytes'] / 2 ** 20:.0f} MiB, "
               f"{s['intermediate_bytes_per_device'] / 2 ** 20:.0f} MiB per trainer device); "
               f"estimate {1e3 * s['est_s']:.1f} ms at {s['bytes_per_s'] / 1e9:.1f} GB/s"
               + ("" if s["same_shape"] else " (+ the intermediate reshard inside the trainer)"))
  for name, flag in plan.get("suggestions", {}).items():
    lines.append(f"  {name} fits with {flag} (the trainer has {plan['trainer_devices']} of the "
                 "chips; the figures above are at that setting)")
  for side, cset in plan.get("compile_set", {}).items():
    lines += [f"{side} side's " + line if i == 0 else line
              for i, line in enumerate(plan_lib.format_compile_set(cset))]
  lines.append("fits: " + ("yes" if plan["fits"] else "NO"))
  return "\n".join(lines)


# ----------------------------------------------------------------------------- the model


def _roofline(parts, mesh, rules, chip) -> dict:
  """The roofline of one step's programs on ``mesh`` (analytic FLOPs; nothing
  compiled), the rollout on the run's sampler (``sampling.engine``) under the
  ASSUMED response lengths ``hw.RESPONSE_LENGTHS``, as the compiled plan's."""
  shards = sh.batch_shard_count(mesh, rules)
  reports = {p.name: plan_lib.ProgramReport(p.name, p.what, p.knobs, p.flops,
                                            flops_by_layout=p.flops_by_layout)
             for p in plan_lib.step_programs(parts, mesh, rules)}
  rf = hw.roofline(parts.model, mesh, chip, shapes_lib.sampler_shapes(parts, shards), reports,
                   engine_shapes=shapes_lib.engine_shapes(parts), engine=parts.sampling.engine)
  rollout = sum(v["total_s"] for k, v in rf.items() if k.startswith("sample_"))
  u = rf["update"]
  return {"rollout_s": rollout, "train_s": u["total_s"],
          "train_padded_s": u.get("padded_s", u["total_s"]),
          "train_packed_s": u.get("packed_s", u["total_s"])}


def modelled_speedup(config, topology: str, rollout_devices: int, *,
                     chunk_bytes: int = 512 * 2 ** 20) -> dict:
  """Roofline step times (seconds, lower bounds): synchronous on every device of
  ``topology`` against asynchronous on the split (steady state, eta >= 1)."""
  devices = hw.topology_devices(topology)
  chip = hw.chip_spec(devices[0])
  parts = plan_lib.plan_parts(config)
  rules = sh.rules_dict(config.mesh.rules)
  full = _roofline(parts, hw.target_mesh(config, devices), rules, chip)
  meshes = split_meshes(config, devices, rollout_devices)
  r = _roofline(parts, meshes.rollout, rules, chip)["rollout_s"]
  t = _roofline(parts, meshes.trainer, rules, chip)["train_s"]
  sync = plan_sync(parts, meshes, chunk_bytes, chip)["est_s"]
  t_sync = full["rollout_s"] + full["train_s"]
  t_async = max(r, t + sync)
  return {"topology": topology, "rollout_devices": rollout_devices,
          "engine": parts.sampling.engine,
          "trainer_devices": meshes.trainer.size,
          "sync_step": {"rollout_s": full["rollout_s"], "train_s": full["train_s"],
                        "step_s": t_sync},
          "async_step": {"rollout_s": r, "train_s": t, "sync_s": sync, "step_s": t_async,
                         "bound": "rollout" if r >= t + sync else "train + sync"},
          "speedup": t_sync / t_async}


# ----------------------------------------------------------------------------- the faithful model (issue 31)
#
# Every split of a topology into whole hosts per side, every rollout mesh of the
# rollout side's devices; the rollout on the continuous engine, drained (each
# call ends with its longest row: today's model) and never drained (the next
# calls' rows take the freed slots under the staleness rule); each decode step
# costs ASSUMED_DECODE_STEP_FIXED_S + the largest of its HBM reads (weights +
# KV), FLOPs and FSDP weight gathers; the update padded and packed (the plan's
# own FLOPs, ``flops_by_layout``); the weight sync as plan_sync estimates it.

# ASSUMED: what the engine's programs take beside the page pool and the params'
# two copies (logits, the window's buffers); to be replaced by the compiled split
# plan's peak (compile_split_plan).
ASSUMED_ENGINE_WORKSPACE_BYTES = 4 * GiB


def decode_cost(chip, fixed_s: float = hw.ASSUMED_DECODE_STEP_FIXED_S) -> hw.DecodeCost:
  """A decode step's cost beyond the roofline on ``chip``: ``fixed_s`` per step and
  the FSDP weight gathers over ICI (one direction: half of :data:`ICI_BYTES_PER_S`)."""
  return hw.DecodeCost(fixed_s, ICI_BYTES_PER_S.get(chip.name, 0.0) / 2)


def rollout_mesh_candidates(model_cfg, devices: int) -> list[tuple]:
  """Rollout mesh axes (((axis, size), ...)) of ``devices`` devices: tensor each
  power of two up to the KV heads, the weights either replicated over ``data``
  (fsdp 1) or FSDP-sharded over the rest (fsdp = devices / tensor)."""
  out, t = [], 1
  while t <= min(devices, model_cfg.num_kv_heads):
    if devices % t == 0:
      for f in sorted({1, devices // t}):
        out.append((("dcn", 1), ("data", devices // (t * f)), ("fsdp", f), ("tensor", t)))
    t *= 2
  return out


def split_candidates(devices) -> list[int]:
  """Rollout device counts of whole hosts per side whose weight sync can copy shard
  by shard (one side's count a multiple of the other's)."""
  per_host = len([d for d in devices if d.process_index == devices[0].process_index])
  total = len(devices)
  return [n for n in range(per_host, total, per_host)
          if max(n, total - n) % min(n, total - n) == 0]


def _modelled_meshes(config, devices, n: int, rollout_mesh: tuple) -> tuple:
  """(SplitMeshes, why the run refuses it or ""): as the run splits the devices when
  it accepts ``n``; otherwise (several processes: the run needs as many on each
  side) whole hosts per side, the trainer first, for the model only."""
  try:
    return split_meshes(config, devices, n, rollout_mesh), ""
  except split_lib.AsyncConfigError as e:
    why = str(e).split(":")[0] + ": " + str(e).split(":", 1)[1].strip()[:90]
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  rollout_cfg = split_lib.rollout_mesh_config(config.mesh, rollout_mesh)
  meshes = SplitMeshes(hw.target_mesh(config, ordered[:len(devices) - n]),
                       sh.make_mesh(rollout_cfg, ordered[len(devices) - n:]),
                       sh.rules_dict(config.mesh.rules))
  return meshes, why


def engine_slots_that_fit(parts, mesh, rules, budget: float) -> dict:
  """The engine slots (at most ``engine.slots``, a multiple of the batch shards)
  whose page pool fits ``budget`` bytes per device on ``mesh``, the pool sized as
  the engine sizes it for the step's largest call (``planning.engine.describe``:
  each shard's slots hold whole rows, their KV heads split over ``tensor``).
  Raises EngineError when the engine cannot run on ``mesh`` (its batch shards
  per process)."""
  from fbos_jax.engine.runner import Engine
  from fbos_jax.planning import engine as engine_plan
  shapes = {k: v for k, v in shapes_lib.engine_shapes(parts).items() if k.startswith("sample_")}
  ecfg = shapes_lib.engine_config(parts)
  shards = sh.batch_shard_count(mesh, rules)
  most = int(ecfg.slots) // shards * shards  # engine.slots is a multiple of the batch shards
  if most <= 0:
    raise EngineError(f"engine.slots={ecfg.slots} is fewer than the mesh's {shards} batch shards")
  per_slot = 0.0  # bytes per device of one slot of its shard
  for s in shapes.values():
    eng = Engine(parts.model, s.sampling, dataclasses.replace(ecfg, slots=most, staged=0),
                 mesh=mesh, rules=rules)
    d = engine_plan.describe(eng)
    per_slot = max(per_slot, d["pool_bytes_per_device"] / (d["slots"] // d["batch_shards"]))
  fit = int(max(budget, 0) // per_slot) * shards
  return {"slots": min(most, fit), "pool_bytes_per_slot_per_device": per_slot,
          "slots_configured": int(ecfg.slots)}


def rollout_model(parts, mesh, rules, chip, cost: hw.DecodeCost, slots: int,
                  lengths: hw.ResponseLengths = hw.RESPONSE_LENGTHS) -> dict:
  """The step's rollout (its sampler calls on the continuous engine through
  ``slots`` slots, at ``cost`` per decode step): seconds drained (every call ends
  with its longest row) and continuous (never drains), and the weights' share of a
  decode step."""
  out = {"drained_s": 0.0, "continuous_s": 0.0, "calls": {}}
  for name, s in shapes_lib.engine_shapes(parts).items():
    if not name.startswith("sample_"):
      continue
    est = {k: hw.continuous_estimate(parts.model, mesh, chip, s, lengths, cost=cost, slots=slots,
                                     drain=drain)
           for k, drain in (("drained", True), ("continuous", False))}
    out["calls"][name] = est
    for k in ("drained", "continuous"):
      out[f"{k}_s"] += est[k]["total_s"]
  hbm, gathered = hw.decode_weight_bytes(parts.model, mesh.shape)
  out["weight_bytes_per_chip"] = {"hbm": hbm, "gathered": gathered}
  out["weight_s_per_step"] = weight_s_per_step(parts.model, mesh, chip, cost)
  return out


def weight_s_per_step(model_cfg, mesh, chip, cost: hw.DecodeCost) -> float:
  """Seconds of a decode step's weight traffic on one device of ``mesh``: its HBM
  reads, or its FSDP gathers over ICI, whichever takes longer
  (:func:`hardware.decode_weight_bytes`); what the rollout mesh is chosen by."""
  hbm, gathered = hw.decode_weight_bytes(model_cfg, mesh.shape)
  bw = chip.hbm_bandwidth / chip.devices_per_chip
  return max(hbm / bw, gathered / cost.ici_bytes_per_s if cost.ici_bytes_per_s else 0.0)


def _mesh_str(shape) -> str:
  return "x".join(str(shape.get(a, 1)) for a in ("data", "fsdp", "tensor"))


@dataclasses.dataclass(frozen=True)
class _Model:
  """What every row of :func:`split_model` is modelled with."""
  config: object
  devices: list
  parts: object
  rules: dict
  chip: object
  cost: object
  hbm: float
  frac: float
  lengths: object
  chunk_bytes: int


def _sync_step(m: _Model, mesh, full) -> dict:
  """The synchronous step with its rollout on ``mesh`` (all devices) and its update on
  ``full`` (the config's mesh): its slots fit beside the train state and one compute
  copy of the params."""
  need = split_lib.split_bytes(m.parts, full, mesh, m.rules)
  budget = (m.frac * m.hbm - need["trainer"] - need["rollout"] / 2
            - ASSUMED_ENGINE_WORKSPACE_BYTES)
  n_slots = engine_slots_that_fit(m.parts, mesh, m.rules, budget)["slots"]
  r = rollout_model(m.parts, mesh, m.rules, m.chip, m.cost, n_slots, m.lengths)
  t = _roofline(m.parts, full, m.rules, m.chip)
  return {"mesh": _mesh_str(mesh.shape), "slots": n_slots, "rollout_s": r["drained_s"],
          "weight_s_per_step": r["weight_s_per_step"],
          "train_padded_s": t["train_padded_s"], "train_packed_s": t["train_packed_s"],
          **{f"step_{k}_s": r["drained_s"] + t[f"train_{k}_s"] for k in ("padded", "packed")}}


def _split_row(m: _Model, n: int, meshes, refused, sync: dict, trainers: dict,
               run_update: str) -> dict:
  """One row of :func:`split_model`: ``n`` rollout devices on ``meshes``; an
  ``invalid`` row says why it cannot run. ``trainers``: the trainer side's roofline
  by ``n`` (filled here)."""
  parts, rules = m.parts, m.rules
  row = {"rollout_devices": n, "trainer_devices": meshes.trainer.size,
         "rollout_mesh": _mesh_str(meshes.rollout.shape),
         "trainer_mesh": _mesh_str(meshes.trainer.shape), "refused": refused}
  try:
    split_lib.check_rows(parts, meshes.trainer, meshes.rollout, rules)
  except split_lib.AsyncConfigError as e:
    row["invalid"] = str(e)[:120]
  need = split_lib.split_bytes(parts, meshes.trainer, meshes.rollout, rules)
  try:
    fit = engine_slots_that_fit(parts, meshes.rollout, rules,
                                m.frac * m.hbm - need["rollout"] - ASSUMED_ENGINE_WORKSPACE_BYTES)
  except EngineError as e:  # the engine's batch shards per process
    return dict(row, invalid=f"engine: {e}"[:120], slots=0)
  row.update(slots=fit["slots"], rollout_params_bytes=need["rollout"],
             trainer_state_bytes=need["trainer"],
             trainer_state_fits=need["trainer"] <= m.frac * m.hbm)
  if fit["slots"] <= 0:
    row["invalid"] = row.get("invalid") or "no engine slot fits beside the params"
    return row
  if n not in trainers:
    try:
      trainers[n] = _roofline(parts, meshes.trainer, rules, m.chip)
    except sh.ShardingError as e:
      trainers[n] = f"trainer mesh {row['trainer_mesh']}: {e}"[:120]
  t = trainers[n]
  if isinstance(t, str):
    return dict(row, invalid=t)
  r = rollout_model(parts, meshes.rollout, rules, m.chip, m.cost, fit["slots"], m.lengths)
  sy = plan_sync(parts, meshes, m.chunk_bytes, m.chip)["est_s"]
  row.update(weight_s_per_step=r["weight_s_per_step"],
             weight_bytes_per_chip=r["weight_bytes_per_chip"],
             rollout_drained_s=r["drained_s"], rollout_continuous_s=r["continuous_s"],
             train_padded_s=t["train_padded_s"], train_packed_s=t["train_packed_s"],
             sync_s=sy)
  for k in ("padded", "packed"):
    a = max(r["continuous_s"], t[f"train_{k}_s"] + sy)
    row[f"async_{k}_s"] = a
    row[f"async_{k}_drained_s"] = max(r["drained_s"], t[f"train_{k}_s"] + sy)
    row[f"speedup_{k}"] = sync["configured"][f"step_{k}_s"] / a
    row[f"speedup_{k}_vs_decode_mesh_sync"] = sync["decode_mesh"][f"step_{k}_s"] / a
  row["bound"] = ("rollout" if r["continuous_s"] >= t[f"train_{run_update}_s"] + sy
                  else "update + sync")
  return row


def split_model(config, topology: str, *, fixed_s: float = hw.ASSUMED_DECODE_STEP_FIXED_S,
                chunk_bytes: int = 512 * 2 ** 20,
                lengths: hw.ResponseLengths = hw.RESPONSE_LENGTHS) -> dict:
  """The faithful model of ``config``'s asynchronous split on ``topology``
  (seconds per step; analytic, nothing compiled): for every rollout device count
  of :func:`split_candidates` and every rollout mesh of
  :func:`rollout_mesh_candidates`, the rollout continuous and drained
  (:func:`rollout_model`, through the slots whose page pool fits beside two
  params copies and ASSUMED_ENGINE_WORKSPACE_BYTES), the update padded and
  packed on the trainer mesh, the weight sync (:func:`plan_sync`), and

  * ``sync = rollout(all, drained) + train(all)`` on the config's mesh (and on
    the decode mesh of all devices, for reference), the config's engine slots;
  * ``async = max(rollout(N, continuous), train(rest) + sync)``.

  The rollout mesh chosen for each N reads the fewest weight bytes per chip per
  step (``weight_s_per_step``: HBM reads and FSDP gathers) among those that fit
  and whose rows the trainer's batch shards divide. ``best``: the fastest chosen
  split the run accepts (``runs``), else None."""
  devices = hw.topology_devices(topology)
  chip = hw.chip_spec(devices[0])
  m = _Model(config=config, devices=devices, parts=plan_lib.plan_parts(config),
             rules=sh.rules_dict(config.mesh.rules), chip=chip, cost=decode_cost(chip, fixed_s),
             hbm=hw.hbm_bytes(devices[0]), frac=hw.fit_fraction(devices[0]), lengths=lengths,
             chunk_bytes=chunk_bytes)
  parts, rules = m.parts, m.rules
  run_update = "packed" if parts.update.packed else "padded"
  full = hw.target_mesh(config, devices)
  sync = {"configured": _sync_step(m, full, full)}
  decode = []  # the rollout meshes of all devices the engine runs on, by weight time
  for rm in rollout_mesh_candidates(parts.model, len(devices)):
    mesh = sh.make_mesh(split_lib.rollout_mesh_config(config.mesh, rm), devices)
    try:
      engine_slots_that_fit(parts, mesh, rules, 0)
    except EngineError:
      continue
    decode.append((weight_s_per_step(parts.model, mesh, chip, m.cost), mesh))
  # the synchronous loop's rollout resharded to the decode mesh (not what it does
  # today): what the split gains beyond choosing a decode layout
  sync["decode_mesh"] = _sync_step(m, min(decode, key=lambda x: x[0])[1], full)
  rows, trainers = [], {}
  for n in split_candidates(devices):
    for rm in rollout_mesh_candidates(parts.model, n):
      try:
        meshes, refused = _modelled_meshes(config, devices, n, rm)
      except (sh.ShardingError, hw.PlanError, split_lib.AsyncConfigError):
        continue
      rows.append(_split_row(m, n, meshes, refused, sync, trainers, run_update))
  for n in sorted({r["rollout_devices"] for r in rows}):
    ok = [r for r in rows if r["rollout_devices"] == n and "invalid" not in r]
    if ok:
      min(ok, key=lambda r: (r["weight_s_per_step"], -r["slots"]))["chosen"] = True
  chosen = [r for r in rows if r.get("chosen")]
  key = lambda r: r[f"async_{run_update}_s"]
  runs = [r for r in chosen if not r["refused"] and r["trainer_state_fits"]]
  return {"topology": topology, "chip": chip.name, "update": run_update,
          "assumptions": {"ASSUMED_DECODE_STEP_FIXED_S": fixed_s,
                          "ASSUMED_ENGINE_WORKSPACE_BYTES": ASSUMED_ENGINE_WORKSPACE_BYTES,
                          "DCN_BYTES_PER_S_PER_HOST": DCN_BYTES_PER_S_PER_HOST,
                          "ici_bytes_per_s_one_direction": m.cost.ici_bytes_per_s,
                          "response_lengths": lengths.describe(
                              parts.sampling.round1.max_new_tokens)},
          "sync": sync, "rows": rows,
          "best": min(runs, key=key) if runs else None,
          "best_any": min(chosen, key=key) if chosen else None}


def format_split_model(m: dict) -> str:
  """The model's table: one line per (rollout devices, rollout mesh), the chosen
  mesh of each split marked *, then the best split."""
  u = m["update"]
  lines = []
  for k, s in m["sync"].items():
    lines.append(f"synchronous on all chips, {k} rollout mesh {s['mesh']} (data x fsdp x tensor),"
                 f" {s['slots']} slots: rollout (drained) {s['rollout_s']:.1f} s + update padded "
                 f"{s['train_padded_s']:.1f} / packed {s['train_packed_s']:.1f} s = "
                 f"{s['step_padded_s']:.1f} / {s['step_packed_s']:.1f} s per step")
  lines.append(f"{'N':>3} {'T':>3}  {'rollout mesh':<12} {'W GB/chip':>9} {'wt ms':>6} "
               f"{'slots':>5} {'roll drain':>10} {'roll cont':>9} {'upd pad':>7} "
               f"{'upd pack':>8} {'sync':>5} {'async pad':>9} {'async pack':>10} "
               f"{'x pad':>5} {'x pack':>6} {'x pack/D':>8}  note")
  for r in m["rows"]:
    head = (f"{r['rollout_devices']:>3} {r['trainer_devices']:>3}{'*' if r.get('chosen') else ' '} "
            f"{r['rollout_mesh']:<12}")
    if "weight_s_per_step" not in r:
      lines.append(f"{head} {'':>9} {'':>6} {r['slots']:>5}  {r['invalid']}")
      continue
    w = r["weight_bytes_per_chip"]
    notes = [r["invalid"][:60]] if "invalid" in r else []
    if r["refused"]:
      notes.append("the run refuses this N")
    if not r["trainer_state_fits"]:
      notes.append("trainer state does not fit")
    lines.append(
        f"{head} {(w['hbm'] + w['gathered']) / 1e9:>9.2f} {1e3 * r['weight_s_per_step']:>6.1f} "
        f"{r['slots']:>5} {r['rollout_drained_s']:>10.1f} {r['rollout_continuous_s']:>9.1f} "
        f"{r['train_padded_s']:>7.1f} {r['train_packed_s']:>8.1f} {r['sync_s']:>5.2f} "
        f"{r['async_padded_s']:>9.1f} {r['async_packed_s']:>10.1f} {r['speedup_padded']:>5.2f} "
        f"{r['speedup_packed']:>6.2f} {r['speedup_packed_vs_decode_mesh_sync']:>8.2f}  "
        f"{'; '.join(notes)}")
  b = m["best"]
  if b:
    lines.append(f"best split (the run's {u} update): rl.rollout_devices={b['rollout_devices']}, "
                 f"rollout mesh {b['rollout_mesh']} (data x fsdp x tensor), {b['slots']} slots: "
                 f"async {b[f'async_{u}_s']:.1f} s vs sync {m['sync']['configured'][f'step_{u}_s']:.1f}"
                 f" s per step = {b[f'speedup_{u}']:.2f}x ({b['bound']}-bound); against the "
                 f"synchronous step on the decode mesh "
                 f"{m['sync']['decode_mesh'][f'step_{u}_s']:.1f} s: "
                 f"{b[f'speedup_{u}_vs_decode_mesh_sync']:.2f}x")
  else:
    lines.append("best split: none the run accepts")
  return "\n".join(line.rstrip() for line in lines)
