"""Static sampler vs continuous engine on the same rollout workload, in one run.

    python launch/bench_rollout.py                 # ~2-4 minutes on 2 cores
    python launch/bench_rollout.py --repeats=5 --slots=64 --prompts=512

Workload ``long_tail`` (issue 22 (a)): a random tiny Qwen3 (vocab 512, hidden 128,
2 layers, 4 heads / 2 kv heads of 32, float32) samples ``--n`` rows for each of
``--prompts`` prompts of 8-48 tokens at temperature 1. Each prompt gets an EOS
logit bias (the same per-prompt bias in both samplers, ``logit_bias=``) that
sets its rows' per-step stop probability to 1 / m, m drawn lognormal
(median ``--median_len``, sigma ``--sigma``), so row lengths are a long-tailed
mix capped by ``--max_new_tokens``; the run prints the lengths' median and p99
(the issue asks p99 / median >= 8).

Both sides get the same slots: the static sampler runs ``--slots / n`` prompts
per call (``sampling.batch_buckets``), i.e. ``--slots`` rows at a time, each
call until its longest row stops; the engine keeps ``--slots`` rows decoding
and refills a slot as soon as its row stops. Every figure is the median of
``--repeats`` timed runs after one warm-up run each (compiles excluded), the
two samplers timed in alternation (A B A B ...) so that both see the same
background load; wall time is end-to-end ``sample()`` (host input and output
included).

Workload ``two_round`` (issues 22 (b), 32): one FBOS step of the tiny config
(``configs/fbos.py:tiny``: 8 prompts of the sorting task, n = m = 8, the compact
verifier in its thread pool) under three schedules with the same key, so the
same rollouts: on the continuous engine with round 2 behind the barrier
(``rl.stream_rounds=False``) and streamed in (``True``), each rollout verified
as it stops, and on the static sampler (barrier). The model is the tiny config's
random init with its EOS embedding row scaled by ``--eos_scale`` (a random model
rarely stops otherwise), and ``--two_round_max_new_tokens`` new tokens: lengths
median ~5, p90 ~30, p99 at the cap. Timed: ``rollout.rollout_step`` (sampling,
verification, FAPs, batches), median of ``--repeats`` alternating runs after
``--warmups`` untimed ones each. Printed per schedule: wall time and the
critical path: sequential decode steps, slot-steps, KV positions read, and a
modelled accelerator time, decode steps x a fixed per-step cost + KV reads x a
per-position cost, the costs NAMED (``--cost_model``'s weights and KV bytes at
``--cost_chip``'s HBM bandwidth, ``fbos_jax.planning.hardware.decode_step_cost``: an
assumption, not a measurement; on an accelerator a memory-bound step costs
about the same at 16 rows as at 64, so the decode steps are what streaming
saves, while on a CPU a step costs in proportion to its rows). The "same
tokens" check compares every batch's tokens exactly. ``streamed_decode_steps_floor``:
the fewest decode steps any schedule of the same rollouts can take (round 1
from step 0, every verdict at once, a round-2 row after the round-1 rows it
waits for: ``rollout/round2_chain_steps``), so what streaming can save at most.

Workload ``slow_verifier`` (issue 32): ``two_round``'s barrier and streamed
schedules with every verdict taking ``--slow_verifier_ms`` (20 ms: a sleep, as a
remote sandbox or judge service's latency) in the pool ``verifier.workers``
sizes (the config's, or ``--slow_verifier_workers``): whether streaming hides
verification behind decoding in wall time. ``streamed_s_floor``: the verifier's
floor, ceil(rollouts / workers) x the latency (every rollout is verified once,
round 1's and round 2's), below which no schedule can end.

Printed per sampler (``long_tail``): generated tokens/s, slot utilisation
(generated tokens / slot-steps computed: static = rows x steps of every call,
engine = rows x steps of every window), wall time, and for the engine where its
time goes (windows incl. device work, host scheduling, prefill calls, windows,
refills). The last line is JSON (``--workloads=row_cost`` adds what a decode
step costs at 8-64 rows, the static sampler, no stops): ``{"long_tail":
{"static_tok_s", "continuous_tok_s", "ratio", ...}, "two_round": {"barrier_s",
"streamed_s", "static_s", "barrier_decode_steps", "streamed_decode_steps",
"static_decode_steps", "streamed_decode_steps_floor", "*_slot_steps", "*_kv_reads",
"*_modelled_s", "tokens_equal", ...}, "slow_verifier": {"barrier_s", "streamed_s", "streamed_s_floor", ...}}``.
"""

from __future__ import annotations

import json
import statistics
import time

from absl import app, flags
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fbos_jax import engine as engine_lib  # noqa: E402
from fbos_jax import sampling  # noqa: E402
from fbos_jax.model import qwen  # noqa: E402

MODEL = dict(model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=384,
             num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10_000.0)


_F = flags.FLAGS
flags.DEFINE_integer("prompts", 256, "long_tail: prompts")
flags.DEFINE_integer("n", 4, "long_tail: samples per prompt")
flags.DEFINE_integer("slots", 32, "long_tail: rows decoding at once (both samplers)")
flags.DEFINE_integer("max_new_tokens", 160, "long_tail: the length cap")
flags.DEFINE_float("median_len", 12.0, "long_tail: median of the per-prompt mean length")
flags.DEFINE_float("sigma", 1.0, "long_tail: lognormal sigma of the mean length")
flags.DEFINE_integer("window", 32, "long_tail: engine.window")
flags.DEFINE_integer("page_size", 16, "long_tail: engine.page_size")
flags.DEFINE_float("refill_fraction", 0.125, "long_tail: engine.refill_fraction")
flags.DEFINE_integer("repeats", 3, "timed runs per side (the median is reported)")
flags.DEFINE_integer("seed", 0, "model, prompts and keys")
flags.DEFINE_float("eos_scale", 15.0, "two_round: EOS embedding row scale")
flags.DEFINE_integer("two_round_max_new_tokens", 128, "two_round: sampling.max_new_tokens")
flags.DEFINE_integer("two_round_slots", 64, "two_round: engine.slots")
flags.DEFINE_integer("two_round_window", 8, "two_round: engine.window")
flags.DEFINE_integer("warmups", 3, "two_round: untimed runs of each side first")
flags.DEFINE_integer("slow_verifier_ms", 20, "slow_verifier: latency of every verdict")
flags.DEFINE_integer("slow_verifier_workers", 0, "slow_verifier: verifier.workers (0: the "
                     "config's)")
flags.DEFINE_string("cost_model", "qwen_8b_h100", "the model (a configs/base.py variant) whose "
                    "decode step prices the critical path (modelled time)")
flags.DEFINE_string("cost_chip", "NVIDIA H100", "the chip (fbos_jax.planning.hardware.CHIP_SPECS) of "
                    "the modelled time")
flags.DEFINE_list("workloads", ["long_tail", "two_round", "slow_verifier"], "which workloads "
                  "to run (long_tail, two_round, slow_verifier, row_cost)")


def build(args):
  cfg = qwen.ModelConfig(**MODEL)
  rng = np.random.default_rng(args.seed)
  params = jax.tree.map(  # qwen.init_params' recipe, drawn with numpy (no init compile)
      lambda s: jnp.asarray(np.ones(s[0]) if s[1][-1] == "norm" else
                            0.02 * rng.standard_normal(s[0]), jnp.float32),
      qwen.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[0], tuple))
  v = cfg.vocab_size
  eos = v - 1
  prompts = [rng.integers(1, eos, int(k)).tolist()
             for k in rng.integers(8, 49, args.prompts)]
  mean_len = np.exp(np.log(args.median_len) + args.sigma * rng.standard_normal(args.prompts))
  p = np.clip(1.0 / np.maximum(mean_len, 1.0), 1e-6, 0.999)
  bias = np.zeros((args.prompts, v), np.float32)
  bias[:, eos] = np.log(p * (v - 1) / (1 - p))  # P(eos) ~ p under near-uniform logits
  return cfg, params, prompts, bias, eos


SCHEDULES = {"barrier": {"rl.stream_rounds": False},
             "streamed": {"rl.stream_rounds": True},
             "static": {"sampling.engine": "static", "rl.stream_rounds": False}}


def cost_model(args):
  """(description, fixed s per decode step, s per KV position read): the NAMED
  per-step cost the critical-path counts are priced with (an assumption, not a
  measurement: ``fbos_jax.planning.hardware.decode_step_cost``)."""
  import configs.base as base
  from fbos_jax.planning import hardware
  cfg = qwen.ModelConfig(**base.VARIANTS[args.cost_model]["model"])
  chip = hardware.CHIP_SPECS[args.cost_chip]
  fixed, per_pos = hardware.decode_step_cost(cfg, chip)
  desc = (f"assumed per-step cost: {args.cost_model}'s model ({cfg.num_layers} layers, "
          f"{cfg.compute_dtype}) on one {chip.name} at {chip.hbm_bandwidth / 1e12:.2f} TB/s: "
          f"{1e3 * fixed:.2f} ms fixed (its weights) + {1e9 * per_pos:.1f} ns per KV position read")
  return desc, fixed, per_pos


def rounds_workload(args, name: str, schedules: tuple, latency_s: float = 0.0) -> dict:
  """One FBOS step of the tiny config under each of ``schedules`` (the same key,
  so the same rollouts): wall time, the critical path (decode steps, slot-steps,
  KV reads) and the modelled accelerator time; ``latency_s`` > 0: every verdict
  takes that long (``LatencyVerifier``) in the pool ``verifier.workers`` sizes
  (``--slow_verifier_workers``, default the config's)."""
  import tempfile
  import configs
  from fbos_jax import data as data_lib
  from fbos_jax import sharding as sh
  from fbos_jax.rl import rollout, state as state_lib
  from fbos_jax.rl.context import RolloutContext
  from fbos_jax.testing.verifiers import LatencyVerifier
  from fbos_jax.verifiers.base import make_verifier
  slots = args.two_round_slots
  # a few fixed row / page-table buckets: the streamed run's admissions vary with
  # when verdicts arrive, and each new bucket would be a compile inside a timed run
  over = {"sampling.engine": "continuous", "engine.slots": slots,
          "engine.window": args.two_round_window,
          "engine.row_buckets": (slots // 4, slots // 2, slots), "engine.page_buckets": (8, 16, 48),
          "sampling.max_new_tokens": args.two_round_max_new_tokens,
          "templates.max_prompt_tokens": 640, "sampling.fap_prompt_buckets": (128, 256, 640)}
  if latency_s and args.slow_verifier_workers:
    over["verifier.workers"] = args.slow_verifier_workers
  workdir = tempfile.mkdtemp(prefix=f"bench_{name}_")
  mesh = sh.make_mesh({"data": 1}, devices=jax.devices()[:1])
  ctxs = {}
  for sched in schedules:
    c = configs.load("configs/fbos.py:tiny", dict(over, **SCHEDULES[sched]))
    verifier = LatencyVerifier(make_verifier(c.data), latency_s) if latency_s else None
    ctxs[sched] = RolloutContext.build(c, workdir, mesh=mesh, check_budget=False,
                                       verifier=verifier)
  parts = ctxs[schedules[0]].parts
  eos = ctxs[schedules[0]].tokenizer.eos_token_id
  state = state_lib.init_state(parts, mesh, sh.rules_dict(c.mesh.rules))
  params = dict(state_lib.compute_params(state.params, parts.model))
  params["embed"] = params["embed"].at[eos].multiply(args.eos_scale)
  examples = next(data_lib.make_prompt_iterator(c.data, batch_size=parts.rollout.prompts_per_step,
                                                process_index=0, process_count=1, seed=args.seed))
  key = state_lib.stream_key(state.rng, "sample", 0)
  # every engine program a run can call, compiled before the timed runs (the
  # streamed schedule's row and page buckets vary with when verdicts arrive)
  from fbos_jax import compile_set
  t0 = time.perf_counter()
  groups = [g for sched in schedules for g in compile_set.run_programs(ctxs[sched], state)
            if g.name.endswith("(engine)")]
  report = compile_set.compile_all(groups)
  print(f"{name}: the engine's compile set, {report['programs']} programs, "
        f"{time.perf_counter() - t0:.0f} s", flush=True)
  runs = {s: [] for s in schedules}
  trajs = {}
  for _ in range(args.warmups):  # warm-up: compiles (the streamed run's buckets vary)
    for sched in schedules:
      rollout.rollout_step(ctxs[sched], params, examples, key)
  for _ in range(args.repeats):
    for sched in schedules:
      t0 = time.perf_counter()
      trajs[sched] = rollout.rollout_step(ctxs[sched], params, examples, key)
      st = ctxs[sched].engine_stats
      mm = dict(trajs[sched].metrics, **({f"engine/{k}": v for k, v in st.as_dict().items()}
                                          if st is not None else {}))
      runs[sched].append((time.perf_counter() - t0, mm))
  for ctx in ctxs.values():
    ctx.close()
  desc, fixed, per_pos = cost_model(args)
  m = trajs[schedules[0]].metrics
  print(f"\nworkload {name}: FBOS tiny step, {m['rollouts/generated']} rollouts, "
        f"{m['tokens/generated']} tokens, round-1 length mean {m['response/length']:.1f}; "
        f"{slots} slots; verifier.workers {ctxs[schedules[0]].pool.num_workers}"
        + (f"; every verdict takes {1e3 * latency_s:.0f} ms (sleep)" if latency_s else ""))
  print(desc)
  print(f"{'schedule':<10} {'wall s':>7} {'decode steps':>13} {'slot-steps':>11} "
        f"{'KV reads':>10} {'modelled s':>11}   runs (s)")
  out: dict = {}
  for sched in schedules:
    walls = [w for w, _ in runs[sched]]
    med = lambda k: statistics.median(float(mm[k]) for _, mm in runs[sched])
    steps, slot_steps, kv = (med(f"rollout/{k}") for k in ("decode_steps", "slot_steps",
                                                            "kv_reads"))
    modelled = steps * fixed + kv * per_pos
    wall = statistics.median(walls)
    print(f"{sched:<10} {wall:7.2f} {steps:13.0f} {slot_steps:11.0f} {kv:10.0f} "
          f"{modelled:11.4f}   " + " ".join(f"{w:.2f}" for w in walls))
    out.update({f"{sched}_s": wall, f"{sched}_decode_steps": steps,
                f"{sched}_slot_steps": slot_steps, f"{sched}_kv_reads": kv,
                f"{sched}_modelled_s": modelled})
    mm = runs[sched][-1][1]
    if "engine/prefills" in mm:
      print(f"  {sched}: {mm['engine/windows']} windows, {mm['engine/prefills']} prefill calls "
            f"({mm['engine/prefill_tokens']} prompt tokens); in the engine {mm['engine/wall_s']:.2f} s, "
            f"windows {mm['engine/window_s']:.2f} s, waiting on verdicts {mm['engine/verify_wait_s']:.2f} s")
      out[f"{sched}_prefills"] = mm["engine/prefills"]
      out[f"{sched}_prefill_tokens"] = mm["engine/prefill_tokens"]
    if "rollout/round2_rows_beside_round1" in mm:
      print(f"  {sched}: round-2 rows decoded beside round 1's tail "
            f"{mm['rollout/round2_rows_beside_round1']:.0f} of {mm['round2/rollouts']}, started "
            f"on their own rollout's verdict before the group's {mm['rollout/round2_rows_before_group']:.0f}")
  if "barrier" in schedules and "streamed" in schedules:
    # the dependency floor: no schedule of these rollouts takes fewer decode steps
    out["streamed_decode_steps_floor"] = float(runs["streamed"][-1][1]["rollout/round2_chain_steps"])
    print(f"decode-step floor of any schedule (round 1 from step 0, every verdict at once; "
          f"a round-2 row after the round-1 rows it waits for): "
          f"{out['streamed_decode_steps_floor']:.0f} = "
          f"{out['streamed_decode_steps_floor'] / out['barrier_decode_steps']:.2f}x the barrier's")
    if latency_s:
      # the verifier's floor: every rollout is verified once, by a pool of W workers
      # each taking latency_s a verdict, so no schedule ends before ceil(N / W) verdicts
      verdicts, workers = int(m["rollouts/generated"]), ctxs[schedules[0]].pool.num_workers
      out["streamed_s_floor"] = -(-verdicts // workers) * latency_s
      print(f"verifier floor of any schedule ({verdicts} verdicts x {1e3 * latency_s:.0f} ms "
            f"over {workers} workers): {out['streamed_s_floor']:.2f} s = "
            f"{out['streamed_s_floor'] / out['barrier_s']:.2f}x the barrier's wall time; streamed "
            f"{out['streamed_s'] / out['streamed_s_floor']:.2f}x the floor")
    out["ratio"] = out["streamed_s"] / out["barrier_s"]
    out["decode_steps_ratio"] = out["streamed_decode_steps"] / out["barrier_decode_steps"]
    out["tokens_equal"] = same_tokens(trajs["barrier"], trajs["streamed"])
    print(f"streamed / barrier: {out['ratio']:.2f}x the wall time, "
          f"{out['decode_steps_ratio']:.2f}x the decode steps, "
          f"{out['streamed_modelled_s'] / out['barrier_modelled_s']:.2f}x the modelled time; "
          f"the same tokens exactly: {out['tokens_equal']}")
  if "static" in schedules and "barrier" in schedules:
    out["static_tokens_equal"] = same_tokens(trajs["barrier"], trajs["static"])
    print(f"static sampler: the same tokens as the engine's barrier: "
          f"{out['static_tokens_equal']} (float-flipped draws may differ)")
  out["cost_model"] = desc
  return out


def same_tokens(a, b) -> bool:
  """Whether two steps' batches hold exactly the same tokens (every batch)."""
  return a.batches.keys() == b.batches.keys() and all(
      np.array_equal(np.asarray(a.batches[k].tokens), np.asarray(b.batches[k].tokens))
      for k in a.batches)


def two_round(args) -> dict:
  """Workload (b): one FBOS step, round 2 behind the barrier, streamed in, and
  on the static sampler."""
  return rounds_workload(args, "two_round", ("barrier", "streamed", "static"))


def slow_verifier(args) -> dict:
  """Issue 32's slow verifier: every verdict takes ``--slow_verifier_ms``."""
  return rounds_workload(args, "slow_verifier", ("barrier", "streamed"),
                         latency_s=args.slow_verifier_ms / 1e3)


def main(argv):
  del argv
  args = _F
  out = {}
  if "long_tail" in args.workloads:
    out["long_tail"] = long_tail(args)
  if "two_round" in args.workloads:
    out["two_round"] = two_round(args)
  if "slow_verifier" in args.workloads:
    out["slow_verifier"] = slow_verifier(args)
  if "row_cost" in args.workloads:
    out["row_cost"] = row_cost(args)
  print(json.dumps(out))


def row_cost(args, rows=(8, 16, 32, 64), steps=128) -> dict:
  """Workload ``row_cost``: what a decode step costs at each row count here (the
  static sampler, ``long_tail``'s model, no stop ids so every row runs ``steps``
  steps): whether idle slots cost time on this machine (compute-bound: about in
  proportion to rows) or not (memory-bound)."""
  cfg, params, prompts, _, _ = build(args)
  key = jax.random.PRNGKey(args.seed + 2)
  out = {}
  print(f"\nworkload row_cost: {steps} decode steps, no stops")
  for r in rows:
    scfg = sampling.make_config(max_new_tokens=steps, temperature=1.0, stop_token_ids=(),
                                prompt_buckets=(64,), batch_buckets=(r,))
    batch = prompts[:r]
    sampling.sample(params, cfg, batch, key=key, config=scfg)  # compiles
    walls = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      sampling.sample(params, cfg, batch, key=key, config=scfg)
      walls.append(time.perf_counter() - t0)
    out[r] = statistics.median(walls) / steps
    print(f"rows {r:3d}: {1e3 * out[r]:.2f} ms per step ({1e6 * out[r] / r:.1f} us per row-step)")
  print(f"{rows[-1]} rows / {rows[0]} rows: {out[rows[-1]] / out[rows[0]]:.1f}x the step time "
        f"for {rows[-1] // rows[0]}x the rows")
  return {"step_s": {str(r): v for r, v in out.items()},
          "ratio": out[rows[-1]] / out[rows[0]]}


def long_tail(args) -> dict:
  if args.slots % args.n:
    raise SystemExit(f"--slots={args.slots} must be a multiple of --n={args.n}")
  cfg, params, prompts, bias, eos = build(args)
  key = jax.random.PRNGKey(args.seed + 1)
  scfg = sampling.make_config(max_new_tokens=args.max_new_tokens, temperature=1.0,
                              stop_token_ids=(eos,), prompt_buckets=(64,),
                              batch_buckets=(args.slots // args.n,))
  ecfg = engine_lib.EngineConfig(slots=args.slots, page_size=args.page_size, window=args.window,
                                 refill_fraction=args.refill_fraction, prefill_chunk=64)
  engine = engine_lib.Engine(cfg, scfg, ecfg, logit_bias=True)
  per_call = args.slots // args.n
  results = {"static": [], "continuous": []}

  def run_static():
    t0 = time.perf_counter()
    out = sampling.sample(params, cfg, prompts, key=key, n_per_prompt=args.n, config=scfg,
                          logit_bias=bias)
    wall = time.perf_counter() - t0
    lengths = out.lengths.reshape(-1, per_call * args.n)  # one row per call
    slot_steps = int(lengths.shape[1] * lengths.max(axis=1).sum())
    return wall, out, {"slot_steps": slot_steps}

  def run_engine():
    stats = engine_lib.EngineStats()
    t0 = time.perf_counter()
    out = engine.sample(params, prompts, key=key, n_per_prompt=args.n, logit_bias=bias,
                        stats=stats)
    wall = time.perf_counter() - t0
    return wall, out, stats.as_dict()

  runners = {"static": run_static, "continuous": run_engine}
  outs = {}
  for name, fn in runners.items():  # warm-up: compiles
    t0 = time.perf_counter()
    _, outs[name], _ = fn()
    print(f"warm-up {name}: {time.perf_counter() - t0:.1f} s (compiles included)", flush=True)
  for _ in range(args.repeats):
    for name, fn in runners.items():
      results[name].append(fn())

  lengths = outs["static"].lengths
  med, p99 = float(np.median(lengths)), float(np.percentile(lengths, 99))
  differ = int((outs["static"].tokens != outs["continuous"].tokens).any(axis=1).sum())
  print(f"\nworkload long_tail: {args.prompts} prompts x {args.n} samples = {lengths.size} rows, "
        f"{int(lengths.sum())} generated tokens; lengths median {med:.0f}, p90 "
        f"{np.percentile(lengths, 90):.0f}, p99 {p99:.0f}, max {lengths.max()} "
        f"(cap {args.max_new_tokens}); p99/median {p99 / med:.1f}; {args.slots} slots; "
        f"rows that differ between the samplers (float-flipped draws): {differ}")
  summary = {}
  print(f"\n{'sampler':<12} {'tok/s':>9} {'slot util':>10} {'wall s':>8}   runs (s)")
  for name, runs in results.items():
    walls = [r[0] for r in runs]
    tokens = int(runs[0][1].lengths.sum())
    slot_steps = statistics.median(r[2]["slot_steps"] for r in runs)
    util = tokens / slot_steps
    wall = statistics.median(walls)
    summary[name] = dict(tok_s=tokens / wall, slot_util=util, wall_s=wall)
    print(f"{name:<12} {tokens / wall:9.0f} {util:10.1%} {wall:8.2f}   "
          + " ".join(f"{w:.2f}" for w in walls))
  st = results["continuous"][len(results["continuous"]) // 2][2]
  print(f"\nengine (median run): {st['windows']} windows ({st['slot_steps'] / max(st['windows'], 1) / args.slots:.1f} "
        f"full-slot steps each), {st['refills']} refills, {st['prefills']} prefill calls, "
        f"pages peak {st['pages_peak']} of {engine.pages.capacity}; time in windows "
        f"(dispatch to results on the host, prefills included) {st['window_s']:.2f} s, "
        f"host scheduling {st['wall_s'] - st['window_s'] - st['verify_wait_s']:.2f} s")
  ratio = summary["continuous"]["tok_s"] / summary["static"]["tok_s"]
  print(f"continuous / static: {ratio:.2f}x tokens/s, wall "
        f"{summary['static']['wall_s'] / summary['continuous']['wall_s']:.2f}x shorter")
  return {
      "static_tok_s": summary["static"]["tok_s"], "continuous_tok_s": summary["continuous"]["tok_s"],
      "ratio": ratio, "static_slot_util": summary["static"]["slot_util"],
      "continuous_slot_util": summary["continuous"]["slot_util"],
      "static_wall_s": summary["static"]["wall_s"],
      "continuous_wall_s": summary["continuous"]["wall_s"],
      "length_median": med, "length_p99": p99, "slots": args.slots}


if __name__ == "__main__":
  app.run(main)
