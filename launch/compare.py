r"""Side-by-side comparison of the algorithms at small scale, with ablations.

  python launch/compare.py --algos=grpo,golf,gfpo,fbos --seeds=3 --workdir=/tmp/cmp
  python launch/compare.py --quick --workdir=/tmp/cmp_quick        # smoke test (~minutes)
  python launch/compare.py --ablations --seeds=3 --workdir=/tmp/abl  # FBOS ablations

Every run starts from the same warm-started (SFT) checkpoint, trained once and
cached in WORKDIR/sft, and sees the same prompt order for a given seed. Runs are
held to the same number of *generated rollouts* (FBOS's round 2 and GOLF's
refinements count against the budget); curves are also reported per update step.

Writes WORKDIR/compare.png, WORKDIR/compare.json and WORKDIR/compare.md.
"""

import _common  # noqa: F401
import json
import os
import time

import numpy as np
from absl import app, flags, logging

flags.DEFINE_string("workdir", None, "Output directory.")
flags.DEFINE_list("algos", ["grpo", "golf", "gfpo", "fbos"], "Config names to compare.")
flags.DEFINE_integer("seeds", 3, "Seeds per algorithm.")
flags.DEFINE_integer("budget", 0, "Generated rollouts per run (0 = the variant default).")
flags.DEFINE_integer("eval_every", 0, "Evaluate every N steps (0 = default).")
flags.DEFINE_bool("quick", False, "Tiny budget and model for a smoke test: checks the files, "
                  "not the results.")
flags.DEFINE_bool("ablations", False, "Run FBOS ablations (EPA only / ECC only / both, f(u) "
                  "denominator one vs behaviour, FAP single vs aggregated) instead of --algos.")
flags.DEFINE_bool("resummarize", False, "Rebuild compare.md / compare.png / the table in "
                  "compare.json from the runs already in WORKDIR/compare.json (no training).")
flags.DEFINE_string("task", "", "Override data.task (e.g. arithmetic).")
flags.DEFINE_multi_string("set", [], "Extra overrides for every run, e.g. --set=rl.terms.ecc.weight=0.5")
FLAGS = flags.FLAGS

ABLATIONS = {
    "fbos_epa_only": ("fbos", "tiny,epa_only"),
    "fbos_ecc_only": ("fbos", "tiny,ecc_only"),
    "fbos": ("fbos", "tiny"),
    "fbos_behaviour": ("fbos", "tiny,behaviour"),
    "fbos_aggregated": ("fbos", "tiny,aggregated"),
}


def load_config(name, arg):
  import importlib.util
  path = os.path.join(_common.ROOT, "configs", f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"cfg_{name}", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg)


def _set(c, key, value):
  obj = c
  *path, last = key.split(".")
  for p in path:
    obj = obj[p]
  cur = obj[last]
  if isinstance(cur, bool):
    value = value in ("1", "true", "True", True)
  elif isinstance(cur, (int, float)) and not isinstance(value, (int, float)):
    value = type(cur)(value)
  obj[last] = value


def shared_setup(c, quick: bool):
  """Fields every run of the comparison shares (task, budget shape, eval set)."""
  if FLAGS.task:
    c.data.task = FLAGS.task
  if quick:
    c.model.num_layers, c.model.hidden_size, c.model.intermediate_size = 1, 64, 128
    c.model.num_heads, c.model.num_kv_heads = 2, 1
    c.sft.steps = 20
    c.train.eval_prompts = 16
    c.sampling.max_new_tokens = 6
  c.train.progress = False
  c.train.checkpoint_every = 0
  c.train.eval_every = 0
  for kv in FLAGS.set:
    k, _, v = kv.partition("=")
    _set(c, k, v)
  return c


def run_one(label, name, arg, seed, sft_params, budget, eval_every, workdir, quick):
  import jax
  from fbos_jax.rl.trainer import RLTrainer
  c = shared_setup(load_config(name, arg), quick)
  c.seed = seed
  c.data.shuffle_seed = 0  # + seed inside the trainer: same order for every algo at a seed
  wd = os.path.join(workdir, "runs", f"{label}_s{seed}")
  tr = RLTrainer(c, wd, init_params=sft_params)
  state = tr.init_state()
  evals = tr.env.eval_examples()
  used, step = 0, 0
  rows = []
  k = c.train.eval_k  # greedy pass@1, plus pass@1 at T=1 over k samples (lower variance)
  ev = tr.evaluate(state.params, evals, k=k, step=0)
  rows.append({"step": 0, "rollouts": 0, **ev})
  t0 = time.perf_counter()
  while used < budget:
    state, m = tr.train_step(state, step)
    step += 1
    used += int(m["rollouts/generated"])
    row = {"step": step, "rollouts": used,
           **{k: v for k, v in m.items() if isinstance(v, (int, float))}}
    if step % eval_every == 0 or used >= budget:
      row.update(tr.evaluate(state.params, evals, k=k, step=step))
    rows.append(row)
  tr.close()
  return {"label": label, "seed": seed, "rows": rows, "seconds": time.perf_counter() - t0}


def _final(rows, key):
  vals = [r[key] for r in rows if key in r]
  return vals[-1] if vals else float("nan")


def _mean_over(rows, key):
  vals = [r[key] for r in rows if key in r and r["step"] > 0]
  return float(np.mean(vals)) if vals else float("nan")


def rollouts_to_reach(rows, target):
  """Interpolated rollouts at which held-out accuracy first reaches ``target``."""
  pts = [(r["rollouts"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
  for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
    if y0 >= target:
      return float(x0)
    if y1 >= target:
      return float(x0 + (x1 - x0) * (target - y0) / max(y1 - y0, 1e-9))
  return float(pts[0][0]) if pts and pts[0][1] >= target else float("nan")


def mean_accuracy_over_budget(rows, budget, key="eval/accuracy"):
  """Area under the accuracy-vs-rollouts curve / budget: how fast a run learns."""
  pts = [(r["rollouts"], r[key]) for r in rows if key in r]
  if not pts:
    return float("nan")
  xs, ys = zip(*pts)
  grid = np.linspace(0, budget, 101)
  return float(np.mean(np.interp(grid, xs, ys)))


def summarize(results, sft_len, budget=None):
  labels = list(dict.fromkeys(r["label"] for r in results))
  by = {l: [r for r in results if r["label"] == l] for l in labels}
  base = next((b for b in ("grpo", "fbos") if b in by), labels[0])  # the reference run
  base_final = float(np.mean([_final(r["rows"], "eval/accuracy") for r in by[base]]))
  base_len = float(np.mean([_mean_over(r["rows"], "response/length") for r in by[base]]))
  table = {}
  for l, runs in by.items():
    fin = [_final(r["rows"], "eval/accuracy") for r in runs]
    fin_s = [_final(r["rows"], "eval/pass@1_sampled") for r in runs]
    b = budget or max(r["rows"][-1]["rollouts"] for r in runs)
    auc = [mean_accuracy_over_budget(r["rows"], b) for r in runs]
    reach = [rollouts_to_reach(r["rows"], base_final) for r in runs]
    base_reach = [rollouts_to_reach(r["rows"], base_final) for r in by[base]]
    ent = [_mean_over(r["rows"], "policy/entropy") for r in runs]
    gn = [_mean_over(r["rows"], "policy/grad_norm") for r in runs]
    ln = [_mean_over(r["rows"], "response/length") for r in runs]
    zero = [_mean_over(r["rows"], "groups/all_equal_frac") for r in runs]
    fix = [_mean_over(r["rows"], "feedback/fix_rate") for r in runs]
    inj = [_mean_over(r["rows"], "epa/injected") for r in runs]
    elr = float("nan")
    if base_len - sft_len != 0:
      elr = float((base_len - np.mean(ln)) / (base_len - sft_len))
    ratio = float(np.nanmean(base_reach) / np.nanmean(reach)) if np.isfinite(np.nanmean(reach)) \
        and not np.all(np.isnan(reach)) else float("nan")
    stat = lambda xs: {"mean": float(np.nanmean(xs)) if not np.all(np.isnan(xs)) else float("nan"),
                       "std": float(np.nanstd(xs)) if not np.all(np.isnan(xs)) else float("nan")}
    table[l] = {"final_accuracy": stat(fin), "final_sampled_accuracy": stat(fin_s),
                "mean_accuracy_over_budget": stat(auc), "rollouts_to_grpo_final": stat(reach),
                "sample_efficiency_vs_grpo": ratio, "entropy": stat(ent), "grad_norm": stat(gn),
                "response_length": stat(ln), "all_equal_groups": stat(zero),
                "fix_rate": stat(fix), "injected_per_step": stat(inj),
                "excess_length_reduction": elr,
                "reached_grpo_final": int(np.sum(~np.isnan(reach))), "seeds": len(runs),
                "reference": base}
  return table


def markdown(table):
  f = lambda s, p=3: ("n/a" if not np.isfinite(s["mean"]) else f"{s['mean']:.{p}f} ± {s['std']:.{p}f}")
  ref = next(iter(table.values()))["reference"] if table else "grpo"
  ref = "GRPO" if ref == "grpo" else ref
  lines = [f"| run | final acc (greedy) | final acc (T=1) | mean acc over budget | rollouts to {ref}'s final acc | sample eff. vs {ref} | entropy | grad norm | length | ELR | fix rate | all-equal groups |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for l, t in table.items():
    eff = t["sample_efficiency_vs_grpo"]
    elr = t["excess_length_reduction"]
    lines.append(
        f"| {l} | {f(t['final_accuracy'])} | {f(t['final_sampled_accuracy'])} "
        f"| {f(t['mean_accuracy_over_budget'])} "
        f"| {f(t['rollouts_to_grpo_final'], 0)} "
        f"({t['reached_grpo_final']}/{t['seeds']}) | {'n/a' if not np.isfinite(eff) else f'{eff:.2f}x'} "
        f"| {f(t['entropy'])} | {f(t['grad_norm'])} | {f(t['response_length'], 2)} "
        f"| {'n/a' if not np.isfinite(elr) else f'{100 * elr:.0f}%'} | {f(t['fix_rate'])} "
        f"| {f(t['all_equal_groups'])} |")
  return "\n".join(lines)


def plot(results, out_png):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  panels = [("rollouts", "eval/accuracy", "held-out accuracy vs rollouts"),
            ("rollouts", "eval/pass@1_sampled", "held-out accuracy (T=1, mean of k) vs rollouts"),
            ("step", "eval/accuracy", "held-out accuracy vs update steps"),
            ("rollouts", "reward/round1", "training reward (round 1)"),
            ("rollouts", "policy/entropy", "policy entropy"),
            ("rollouts", "policy/grad_norm", "gradient norm"),
            ("rollouts", "response/length", "response length"),
            ("rollouts", "groups/all_equal_frac", "all-equal (zero-signal) groups")]
  fig, axes = plt.subplots(2, 4, figsize=(20, 8))
  labels = list(dict.fromkeys(r["label"] for r in results))
  colors = {l: f"C{i}" for i, l in enumerate(labels)}
  for ax, (x, y, title) in zip(axes.flat, panels):
    for l in labels:
      runs = [r for r in results if r["label"] == l]
      for i, r in enumerate(runs):
        pts = [(row[x], row[y]) for row in r["rows"] if y in row]
        if pts:
          xs, ys = zip(*pts)
          ax.plot(xs, ys, color=colors[l], alpha=0.35 if len(runs) > 1 else 1.0,
                  label=l if i == 0 else None)
      # mean curve over seeds (on the first seed's x grid for eval curves)
      if len(runs) > 1 and y.startswith("eval/"):
        grids = [[row[y] for row in r["rows"] if y in row] for r in runs]
        n = min(len(g) for g in grids)
        xs = [row[x] for row in runs[0]["rows"] if y in row][:n]
        ax.plot(xs, np.mean([g[:n] for g in grids], 0), color=colors[l], lw=2.5)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(x)
    ax.grid(alpha=0.3)
  axes.flat[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out_png, dpi=90)
  plt.close(fig)


def main(argv):
  del argv
  import jax
  from fbos_jax.rl import sft as sft_lib
  from fbos_jax.rl.env import Environment
  from fbos_jax.rl.trainer import RLTrainer
  if not FLAGS.workdir:
    raise app.UsageError("--workdir is required")
  if FLAGS.resummarize:
    with open(os.path.join(FLAGS.workdir, "compare.json")) as f:
      data = json.load(f)
    write_outputs(data["runs"], data["warm_start"], data["budget_rollouts"], data["seeds"],
                  data["wall_seconds"])
    return
  t_start = time.perf_counter()
  os.makedirs(FLAGS.workdir, exist_ok=True)
  runs = ([(l, n, a) for l, (n, a) in ABLATIONS.items()] if FLAGS.ablations
          else [(a, a, "tiny") for a in FLAGS.algos])
  # ---- one shared warm start
  base_cfg = shared_setup(load_config("grpo", "tiny"), FLAGS.quick)
  tr0 = RLTrainer(base_cfg, os.path.join(FLAGS.workdir, "warm_start"))
  sft_params, cached = sft_lib.warm_start(base_cfg, tr0.env, tr0.init_state().params, mesh=tr0.mesh,
                                          cache_dir=os.path.join(FLAGS.workdir, "sft"))
  sft_eval = tr0.evaluate(sft_params, tr0.env.eval_examples(), k=base_cfg.train.eval_k)
  print(f"warm start: held-out accuracy {sft_eval['eval/accuracy']:.3f} (greedy), "
        f"{sft_eval.get('eval/pass@1_sampled', float('nan')):.3f} (T=1), "
        f"length {sft_eval['eval/length']:.2f} ({'cached' if cached else 'trained'})", flush=True)
  tr0.close()
  budget = FLAGS.budget or (64 if FLAGS.quick else 128 * base_cfg.train.steps)
  eval_every = FLAGS.eval_every or (2 if FLAGS.quick else 5)
  seeds = 1 if FLAGS.quick else FLAGS.seeds
  results = []
  from tqdm.auto import tqdm
  bar = tqdm([(r, s) for r in runs for s in range(seeds)], desc="compare", dynamic_ncols=True)
  for (label, name, arg), seed in bar:
    bar.set_postfix(run=f"{label} s{seed}")
    res = run_one(label, name, arg, seed, sft_params, budget, eval_every, FLAGS.workdir, FLAGS.quick)
    results.append(res)
    logging.info("%s seed %d: final acc %.3f in %.0fs", label, seed,
                 _final(res["rows"], "eval/accuracy"), res["seconds"])
  write_outputs(results, sft_eval, budget, seeds, time.perf_counter() - t_start)


def write_outputs(results, sft_eval, budget, seeds, wall):
  """compare.json (all numbers), compare.md (the table) and compare.png."""
  table = summarize(results, sft_eval["eval/length"], budget)
  out = {"budget_rollouts": budget, "seeds": seeds, "warm_start": sft_eval, "wall_seconds": wall,
         "table": table, "runs": results}
  with open(os.path.join(FLAGS.workdir, "compare.json"), "w") as f:
    json.dump(out, f, indent=1, default=float)
  md = markdown(table)
  with open(os.path.join(FLAGS.workdir, "compare.md"), "w") as f:
    f.write(f"Budget: {budget} generated rollouts per run, {seeds} seed(s), warm start accuracy "
            f"{sft_eval['eval/accuracy']:.3f} (greedy), "
            f"{sft_eval.get('eval/pass@1_sampled', float('nan')):.3f} (T=1); "
            f"wall time {wall / 60:.1f} min.\n\n{md}\n")
  plot(results, os.path.join(FLAGS.workdir, "compare.png"))
  print(md)
  print(f"wall time: {wall / 60:.1f} min; files in {FLAGS.workdir}")


if __name__ == "__main__":
  app.run(main)
