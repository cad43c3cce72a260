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
from fbos_jax.rl import split as split_lib
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import shapes as shapes_lib
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


def split_meshes(config, devices, rollout_devices: int) -> SplitMeshes:
  """The two meshes of ``rollout_devices`` on ``devices`` (as the run splits them:
  in one process, or whole processes per side, ``fbos_jax.rl.split.split_of``)."""
  rollout_cfg = split_lib.rollout_mesh_config(config.mesh,
                                             config_lib.async_config(config).rollout_mesh)
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


def _programs(parts, mesh, rules, names, eval_prompts=0, eval_k=1):
  """The step's programs of the calls ``names`` (a sampler call on the continuous
  engine is two programs, ``NAME/window`` and ``NAME/prefill``). The rollout side
  of a split does not hold the train state."""
  return [p for p in plan_lib.step_programs(parts, mesh, rules, eval_prompts=eval_prompts,
                                            eval_k=eval_k, state_resident=False)
          if p.name.split("/")[0] in names]


def compile_split_plan(config, topology: str, rollout_devices: int, *,
                       chunk_bytes: int = 512 * 2 ** 20,
                       progress: Optional[Callable[[str], None]] = None) -> dict:
  """Compile the split plan of ``config`` on ``topology``: the update on the trainer
  mesh, the rollout samplers on the rollout mesh, the sync planned; every side
  checked to fit (with the numbers; ``fits`` False otherwise)."""
  say = progress or (lambda s: None)
  devices = hw.topology_devices(topology)
  meshes = split_meshes(config, devices, rollout_devices)
  chip = hw.chip_spec(devices[0])
  hbm, frac = hw.hbm_bytes(devices[0]), hw.fit_fraction(devices[0])
  parts = plan_lib.plan_parts(config)
  samplers = tuple(shapes_lib.sampler_shapes(parts, sh.batch_shard_count(meshes.rollout,
                                                                         meshes.rules)))
  reports, suggestions = {}, {}
  for side, mesh, names in (("trainer", meshes.trainer, ("update",)),
                            ("rollout", meshes.rollout, samplers)):
    progs = _programs(parts, mesh, meshes.rules, names)
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
  return {"topology": topology, "chip": chip.name, "hbm_bytes": hbm, "fit_fraction": frac,
          "rollout_devices": rollout_devices, "trainer_devices": meshes.trainer.size,
          "meshes": {"trainer": dict(meshes.trainer.shape), "rollout": dict(meshes.rollout.shape)},
          "programs": reports, "sides": peaks, "sync": sync, "fits": fits,
          "suggestions": suggestions}


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
  lines.append("fits: " + ("yes" if plan["fits"] else "NO"))
  return "\n".join(lines)


# ----------------------------------------------------------------------------- the model


def _roofline(parts, mesh, rules, chip) -> dict:
  """The roofline of one step's programs on ``mesh`` (analytic FLOPs; nothing
  compiled), the rollout on the run's sampler (``sampling.engine``) under the
  ASSUMED response lengths ``hw.RESPONSE_LENGTHS``, as the compiled plan's."""
  shards = sh.batch_shard_count(mesh, rules)
  reports = {p.name: plan_lib.ProgramReport(p.name, p.what, p.knobs, p.flops)
             for p in plan_lib.step_programs(parts, mesh, rules)}
  rf = hw.roofline(parts.model, mesh, chip, shapes_lib.sampler_shapes(parts, shards), reports,
                   engine_shapes=shapes_lib.engine_shapes(parts), engine=parts.sampling.engine)
  rollout = sum(v["total_s"] for k, v in rf.items() if k.startswith("sample_"))
  return {"rollout_s": rollout, "train_s": rf["update"]["total_s"]}


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
