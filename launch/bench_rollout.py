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

Workload ``two_round`` (issue 22 (b)): one FBOS step of the tiny config
(``configs/fbos.py:tiny``: 8 prompts of the sorting task, n = m = 8, the compact
verifier in its thread pool) on the continuous engine, round 2 behind the
barrier (``rl.stream_rounds=False``) and streamed (``True``), the same key, so
the same rollouts. The model is the tiny config's random init with its EOS
embedding row scaled by ``--eos_scale`` (a random model rarely stops otherwise),
and ``--two_round_max_new_tokens`` new tokens: lengths median ~5, p90 ~30, p99 at
the cap. Timed: ``rollout.rollout_step`` (sampling, verification, FAPs, batches),
median of ``--repeats`` alternating runs after ``--warmups`` untimed ones each.

Printed per sampler: generated tokens/s, slot utilisation (generated tokens /
slot-steps computed: static = rows x steps of every call, engine = rows x steps
of every window), wall time, and for the engine where its time goes (windows
incl. device work, host scheduling, prefill calls, windows, refills). The last
line is JSON (``--workloads=row_cost`` adds what a decode step costs at 8-64
rows, the static sampler, no stops): ``{"long_tail": {"static_tok_s", "continuous_tok_s", "ratio",
"static_slot_util", "continuous_slot_util", ...}, "two_round": {"barrier_s", "streamed_s", "ratio", ...}}``.
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
flags.DEFINE_list("workloads", ["long_tail", "two_round"], "which workloads to run "
                  "(long_tail, two_round, row_cost)")


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


def two_round(args) -> dict:
  """Workload (b): one FBOS step, round 2 behind the barrier vs streamed in."""
  import tempfile
  import configs
  from fbos_jax import sharding as sh
  from fbos_jax.rl import rollout, state as state_lib
  from fbos_jax.rl.context import RolloutContext
  slots = args.two_round_slots
  # a few fixed row / page-table buckets: the streamed run's admissions vary with
  # when verdicts arrive, and each new bucket would be a compile inside a timed run
  over = {"sampling.engine": "continuous", "engine.slots": slots,
          "engine.window": args.two_round_window,
          "engine.row_buckets": (slots // 4, slots // 2, slots), "engine.page_buckets": (8, 16, 48),
          "sampling.max_new_tokens": args.two_round_max_new_tokens,
          "templates.max_prompt_tokens": 640, "sampling.fap_prompt_buckets": (128, 256, 640)}
  workdir = tempfile.mkdtemp(prefix="bench_two_round_")
  mesh = sh.make_mesh({"data": 1}, devices=jax.devices()[:1])
  ctxs = {}
  for stream in (False, True):
    c = configs.load("configs/fbos.py:tiny", dict(over, **{"rl.stream_rounds": stream}))
    ctxs[stream] = RolloutContext.build(c, workdir, mesh=mesh, check_budget=False)
  parts = ctxs[False].parts
  eos = ctxs[False].tokenizer.eos_token_id
  state = state_lib.init_state(parts, mesh, sh.rules_dict(c.mesh.rules))
  params = dict(state_lib.compute_params(state.params, parts.model))
  params["embed"] = params["embed"].at[eos].multiply(args.eos_scale)
  from fbos_jax import data as data_lib
  examples = next(data_lib.make_prompt_iterator(c.data, batch_size=parts.rollout.prompts_per_step,
                                                process_index=0, process_count=1, seed=args.seed))
  key = state_lib.stream_key(state.rng, "sample", 0)
  runs, metrics, engine_stats = {False: [], True: []}, {}, {False: [], True: []}
  for _ in range(args.warmups):  # warm-up: compiles (the streamed run's buckets vary)
    for stream in (False, True):
      rollout.rollout_step(ctxs[stream], params, examples, key)
  for _ in range(args.repeats):
    for stream in (False, True):
      t0 = time.perf_counter()
      metrics[stream] = rollout.rollout_step(ctxs[stream], params, examples, key).metrics
      runs[stream].append(time.perf_counter() - t0)
      engine_stats[stream].append(ctxs[stream].engine_stats.as_dict())
  for ctx in ctxs.values():
    ctx.close()
  barrier, streamed = statistics.median(runs[False]), statistics.median(runs[True])
  m = metrics[True]
  print(f"\nworkload two_round: FBOS tiny step, {m['rollouts/generated']} rollouts, "
        f"{m['tokens/generated']} tokens, round-1 length mean {m['response/length']:.1f}; "
        f"{args.two_round_slots} slots; round-2 rows decoded beside round 1's tail: "
        f"{m['rollout/round2_rows_beside_round1']:.0f} of {m['round2/rollouts']}")
  print(f"{'barrier':<12} {barrier:8.2f} s   runs " + " ".join(f"{w:.2f}" for w in runs[False]))
  print(f"{'streamed':<12} {streamed:8.2f} s   runs " + " ".join(f"{w:.2f}" for w in runs[True]))
  for stream, name in ((False, "barrier"), (True, "streamed")):  # where the time goes
    st = engine_stats[stream][len(engine_stats[stream]) // 2]
    print(f"  {name}: {st['windows']} windows, {st['slot_steps']} slot-steps "
          f"(util {st['slot_util']:.1%}), {st['prefills']} prefill calls; in the engine "
          f"{st['wall_s']:.2f} s, of which windows {st['window_s']:.2f} s, waiting on "
          f"verdicts {st['verify_wait_s']:.2f} s")
  print(f"streamed / barrier: {streamed / barrier:.2f}x the rollout wall time")
  same = metrics[False]["tokens/generated"] == m["tokens/generated"]
  return {"barrier_s": barrier, "streamed_s": streamed, "ratio": streamed / barrier,
          "same_rollouts": bool(same), "slots": args.two_round_slots,
          "rows_beside_round1": m["rollout/round2_rows_beside_round1"]}


def main(argv):
  del argv
  args = _F
  out = {}
  if "long_tail" in args.workloads:
    out["long_tail"] = long_tail(args)
  if "two_round" in args.workloads:
    out["two_round"] = two_round(args)
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
