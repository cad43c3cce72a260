r"""The asynchronous system's modelled speedup, and the split plan (issue 25).

  python launch/bench_async.py                                  # qwen_8b_long on v5p:2x4x4, 16 / 16
  python launch/bench_async.py --sync_metrics=/tmp/s/metrics.jsonl \
      --async_metrics=/tmp/a1/metrics.jsonl                     # + measured tiny phase times
  python launch/bench_async.py --plan --config=configs/fbos.py:qwen_8b   # compile the split plan

Prints, and says for each number whether it is measured or modelled:

1. **modelled** (roofline of the compiled plan's programs,
   ``fbos_jax/planning/async_split.py``):
   the step of ``--config`` on ``--topology`` synchronous on every chip
   (rollout + train) against asynchronous on the split (max(rollout, train +
   sync) at steady state, eta >= 1);
2. the same with the **measured** sampler utilization of a synchronous run
   (``rollout/slot_util`` of ``--sync_metrics``: generated tokens per slot-step;
   the static sampler runs every row of a call to its longest row), applied to
   the synchronous rollout, and to the asynchronous one unless the rollout
   streams across batches (``--stream_util``, an assumption, not measured);
3. **measured** on this machine (``--sync_metrics``, ``--async_metrics``): the
   median step time of each run, the phase times, the busy fractions of both
   sides, and the asynchronous step the measured phase times give;
4. **modelled**, the faithful split model (issue 31,
   ``async_split.split_model``): every split of whole hosts and every rollout
   mesh, the rollout continuous (never drains) and drained, each decode step at
   an ASSUMED fixed cost (``--decode_step_fixed_s``) + its bytes, FLOPs and FSDP
   weight gathers, the update padded and packed, the weight sync; the mesh
   chosen for decode and the best split. The last line is JSON.
"""

import json
import os

from absl import app, flags

from fbos_jax import cli

flags.DEFINE_string("config", "configs/fbos.py:qwen_8b_long", "The config to model.")
flags.DEFINE_string("topology", "v5p:2x4x4", "The topology (XLA's TPU compiler, no TPU).")
flags.DEFINE_integer("rollout_devices", 16, "Devices of the rollout mesh.")
flags.DEFINE_string("sync_metrics", "", "metrics.jsonl of a synchronous run (measured).")
flags.DEFINE_multi_string("async_metrics", [], "metrics.jsonl of asynchronous runs (measured).")
flags.DEFINE_float("stream_util", 0.0, "Assumed sampler utilization of a rollout that streams "
                   "across batches (0 = the measured one, as the worker samples batch by batch).")
flags.DEFINE_bool("plan", False, "Compile the split plan of --config on --topology instead.")
flags.DEFINE_float("decode_step_fixed_s", -1.0, "The fixed cost of a decode step in the split "
                   "model (-1 = the ASSUMED hardware.ASSUMED_DECODE_STEP_FIXED_S; set it from a "
                   "TPU measurement).")
FLAGS = flags.FLAGS


def _libtpu_env():
  for k, v in (("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"), ("TPU_STDERR_LOG_LEVEL", "3"),
               ("TPU_MIN_LOG_LEVEL", "3"), ("JAX_PLATFORMS", "cpu")):
    os.environ.setdefault(k, v)


def _median(rows, key):
  import numpy as np
  vals = [r[key] for r in rows if key in r]
  return float(np.median(vals)) if vals else float("nan")


def _measured(path: str) -> dict:
  """Median phase times of a run's steps after the first (compiles), mean busy
  fractions, and the wall time per RL step (its summary.json, evals included)."""
  from fbos_jax import metrics as metrics_lib
  rows = [r for r in metrics_lib.read_jsonl(path) if "time/step_s" in r][1:]
  keys = ("time/step_s", "time/rollout_s", "time/update_s", "async/sync_s", "async/wait_s",
          "rollout/slot_util", "staleness/mean")
  out = {k: _median(rows, k) for k in keys}
  for k in ("async/rollout_busy", "async/trainer_busy"):
    vals = [r[k] for r in rows if k in r]
    out[k] = sum(vals) / len(vals) if vals else float("nan")
  out["steps"] = len(rows)
  summary = os.path.join(os.path.dirname(path), "summary.json")
  if os.path.exists(summary):
    with open(summary) as f:
      sm = json.load(f)
    out["wall_per_step_s"] = sm["rl_seconds"] / max(sm["rl_steps"], 1)
    out["acc_t1"] = (sm.get("pass@1_sampled_start"), sm.get("pass@1_sampled_end"))
  return out


def _say(line=""):
  print(line, flush=True)


def _modelled(config, stream_util: float, util: float):
  from fbos_jax.planning import async_split
  m = async_split.modelled_speedup(config, FLAGS.topology, FLAGS.rollout_devices)
  s, a = m["sync_step"], m["async_step"]
  _say(f"1. MODELLED (roofline of the compiled plan's programs; lower bounds) {FLAGS.config} on "
       f"{FLAGS.topology}:")
  _say(f"   synchronous, all {m['rollout_devices'] + m['trainer_devices']} chips: rollout "
       f"{s['rollout_s']:.1f} s + train {s['train_s']:.1f} s = {s['step_s']:.1f} s/step")
  _say(f"   asynchronous, {m['rollout_devices']} rollout / {m['trainer_devices']} trainer chips: "
       f"max(rollout {a['rollout_s']:.1f} s, train {a['train_s']:.1f} s + sync "
       f"{1e3 * a['sync_s']:.1f} ms) = {a['step_s']:.1f} s/step ({a['bound']}-bound)")
  _say(f"   speedup {m['speedup']:.2f}x")
  if util == util and util > 0 and m["engine"] == "continuous":
    _say(f"2. (not applied: {FLAGS.config} samples with the continuous engine, whose roofline "
         f"above already has the engine's utilization under the assumed lengths; the measured "
         f"{util:.2f} is a static sampler's)")
  elif util == util and util > 0:
    su = stream_util or util
    t_sync = s["rollout_s"] / util + s["train_s"]
    t_async = max(a["rollout_s"] / su, a["train_s"] + a["sync_s"])
    _say(f"2. MODELLED with the MEASURED sampler utilization {util:.2f} (rollout/slot_util of the "
         f"synchronous run){' and an ASSUMED streaming utilization %.2f' % su if stream_util else ''}:")
    _say(f"   synchronous {t_sync:.1f} s/step, asynchronous {t_async:.1f} s/step: speedup "
         f"{t_sync / t_async:.2f}x")
  return m


def _split_model(config):
  """4. The faithful split model (issue 31): every split and rollout mesh."""
  from fbos_jax.planning import async_split
  from fbos_jax.planning import hardware as hw
  fixed = hw.ASSUMED_DECODE_STEP_FIXED_S if FLAGS.decode_step_fixed_s < 0 else FLAGS.decode_step_fixed_s
  split = async_split.split_model(config, FLAGS.topology, fixed_s=fixed)
  a = split["assumptions"]
  _say(f"4. MODELLED, every split of {FLAGS.topology} (fbos_jax/planning/async_split.py:split_model; "
       f"analytic, nothing compiled). ASSUMED: decode step fixed cost "
       f"{1e3 * a['ASSUMED_DECODE_STEP_FIXED_S']:.1f} ms (ASSUMED_DECODE_STEP_FIXED_S, to be "
       f"measured on a TPU); FSDP weights gathered every decode step over ICI at "
       f"{a['ici_bytes_per_s_one_direction'] / 1e9:.0f} GB/s; engine workspace "
       f"{a['ASSUMED_ENGINE_WORKSPACE_BYTES'] / 2 ** 30:.0f} GiB beside the page pool and two "
       f"params copies; weight sync over the hosts' network at "
       f"{a['DCN_BYTES_PER_S_PER_HOST'] * 8 / 1e9:.0f} Gb/s per host; response lengths "
       f"{a['response_lengths']}. N/T: rollout/trainer chips; W: weight bytes a chip moves "
       f"per decode step (HBM reads + gathers), wt: their time; roll drain: each call ends "
       f"with its longest row; roll cont: never drains; x: sync step / async step; * the "
       f"mesh chosen for decode:")
  for line in async_split.format_split_model(split).splitlines():
    _say("   " + line)
  return split


def _measured_section():
  if not FLAGS.sync_metrics and not FLAGS.async_metrics:
    return
  _say("3. MEASURED on this machine (phase times: medians over steps after the first; busy: "
       "means; wall: RL seconds / steps, evals included):")
  runs = ([("sync", FLAGS.sync_metrics)] if FLAGS.sync_metrics else []) + [
      (f"async{i}", p) for i, p in enumerate(FLAGS.async_metrics)]
  base = _measured(FLAGS.sync_metrics) if FLAGS.sync_metrics else None
  for name, path in runs:
    m = _measured(path)
    line = (f"   {name} ({path}): wall {m.get('wall_per_step_s', float('nan')):.3f} s/step, "
            f"rollout {m['time/rollout_s']:.3f} s, update {m['time/update_s']:.3f} s")
    if m["async/rollout_busy"] == m["async/rollout_busy"]:
      line += (f", sync {1e3 * m['async/sync_s']:.1f} ms, trainer waited "
               f"{m['async/wait_s']:.3f} s; busy: rollout {m['async/rollout_busy']:.2f}, "
               f"trainer {m['async/trainer_busy']:.2f}; mean staleness "
               f"{m['staleness/mean']:.2f}")
    if "acc_t1" in m:
      line += f"; held-out T=1 accuracy {m['acc_t1'][0]:.3f} -> {m['acc_t1'][1]:.3f}"
    _say(line)
    if base and name != "sync" and m["async/sync_s"] == m["async/sync_s"]:
      r, u, sy = base["time/rollout_s"], base["time/update_s"], m["async/sync_s"]
      _say(f"     MODELLED from the synchronous run's (uncontended) phase times and this "
           f"run's sync: max(rollout {r:.3f}, update {u:.3f} + sync {sy:.3f}) = "
           f"{max(r, u + sy):.3f} s against {r + u:.3f} s: {(r + u) / max(r, u + sy):.2f}x")
  if base:
    _say("   caveat: the 8 fake devices share this machine's 2 cores, so the two sides of a "
         "split contend for them (an asynchronous run's rollout takes several times the "
         "synchronous one's), and a 4-device trainer runs the tiny update faster than the "
         "8-device one; a wall-clock ratio here measures neither the overlap nor its absence.")


def main(argv):
  del argv
  _libtpu_env()
  import configs
  config = configs.load(FLAGS.config)
  if FLAGS.plan:
    from fbos_jax.planning import async_split
    plan = async_split.compile_split_plan(config, FLAGS.topology, FLAGS.rollout_devices,
                                         progress=lambda s: _say(f"  {s}"))
    _say(async_split.format_split_plan(plan))
    _say(json.dumps({"fits": plan["fits"], "sides": plan["sides"],
                     "sync": {k: v for k, v in plan["sync"].items()}}))
    return
  util = _measured(FLAGS.sync_metrics)["rollout/slot_util"] if FLAGS.sync_metrics else 0.0
  m = _modelled(config, FLAGS.stream_util, util)
  _measured_section()
  split = _split_model(config)
  b = split["best"]
  u = split["update"]
  if b is None or b[f"speedup_{u}_vs_decode_mesh_sync"] <= 1.0:
    _say("what limits it: no split beats the synchronous step on the decode mesh (4.): both "
         "phases scale about linearly with chips (8K-token decode reads a KV cache larger than "
         "the weights, bandwidth-bound per chip; the update is compute-bound), so giving each "
         "phase part of the chips makes each slower by as much as overlapping saves: "
         "max(R / f, U / (1 - f)) >= R + U for every split f, unless the split removes waste "
         "(the drained tail, weight gathers).")
  else:
    sy = split["sync"]["decode_mesh"]
    _say(f"what limits it: the best split is {b['bound']}-bound (rollout never drained "
         f"{b['rollout_continuous_s']:.1f} s vs {u} update {b[f'train_{u}_s']:.1f} s + sync "
         f"{b['sync_s']:.2f} s); against the synchronous step on the same decode layout "
         f"({sy[f'step_{u}_s']:.1f} s) it gains {b[f'speedup_{u}_vs_decode_mesh_sync']:.2f}x, "
         f"from overlapping the phases and not draining the rollout's tail; the rest of the "
         f"{b[f'speedup_{u}']:.2f}x over today's synchronous step is the decode layout "
         f"(no FSDP weight gathers per decode step).")
  _say(json.dumps({
      "modelled_speedup": m["speedup"], "rollout_devices": m["rollout_devices"],
      "split_model": {
          "assumptions": split["assumptions"], "update": split["update"],
          "sync_step_s": {k: {u: s[f"step_{u}_s"] for u in ("padded", "packed")}
                          for k, s in split["sync"].items()},
          "best": None if b is None else {k: b[k] for k in (
              "rollout_devices", "rollout_mesh", "slots", "rollout_continuous_s",
              "rollout_drained_s", "train_padded_s", "train_packed_s", "sync_s",
              "async_padded_s", "async_packed_s", "speedup_padded", "speedup_packed",
              "speedup_padded_vs_decode_mesh_sync", "speedup_packed_vs_decode_mesh_sync",
              "bound")}}}))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
