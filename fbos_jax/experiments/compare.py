"""A comparison of arms at small scale (the library of ``launch/compare.py``,
whose docstring has the command lines; the launcher parses its flags into
:class:`Options` and calls :func:`run` or :func:`resummarize`).

Every arm is a named entry of :data:`ARMS`; :data:`ABLATIONS` is the
pre-registered list. Here: the runs (:func:`warm_starts`, :func:`run_one`), the
learning-rate sweep and its pick (:func:`sweep_table`, :func:`pick_learning_rate`;
the stability bound is the verdict's, :data:`fbos_jax.experiments.verdict.MAX_DROP`),
a ``--resume``'s check (:func:`resumed_runs`), the tables (:func:`summarize`,
:func:`markdown`, :func:`diagnostics_markdown`, :func:`probe_markdown`) and the
curves (:func:`plot`), written by :func:`write_outputs` as WORKDIR/compare.json,
compare.md and compare.png.
"""

import dataclasses
import json
import math
import os
import platform
import time

import numpy as np
from absl import logging

import configs
from fbos_jax.experiments import compare_file
from fbos_jax.experiments import verdict as verdict_lib
from fbos_jax.rl import evaluation


class FlagError(ValueError):
  """A request the comparison refuses (an unknown arm, a ``--resume`` of another
  comparison, ...); the message names the flag (the launcher reports it as a
  usage error)."""


@dataclasses.dataclass(frozen=True)
class Options:
  """What a comparison runs: ``launch/compare.py``'s flags of the same names
  (``arms``: the arm labels it runs, :func:`select_arms`; ``set``: the
  ``--set`` overrides)."""
  workdir: str
  arms: tuple = ("grpo", "golf", "gfpo", "fbos")
  variant: str = "tiny"
  seeds: int = 3
  budget: int = 0
  eval_every: int = 0
  quick: bool = False
  shared_warm_start: bool = False
  probe_batches: int = 10
  probe_only: bool = False
  feedback_probe: bool = True
  note: str = ""
  resume: bool = False
  task: str = ""
  set: tuple = ()
  lrs: tuple = ()
  sweep_seed: int = 0
  valid_prompts: int = 0


@dataclasses.dataclass(frozen=True)
class Arm:
  """One arm: ``configs/{config}.py:{variant}{,flavors}``, stopped at equal
  generated rollouts (``stop='rollouts'``) or at the reference's step count
  (``stop='steps'``)."""
  config: str
  flavors: str = ""
  stop: str = "rollouts"
  what: str = ""


ARMS = {
    "grpo": Arm("grpo", what="GRPO (the reference)"),
    "golf": Arm("golf", what="GOLF (aggregated feedback, adaptive injection)"),
    "gfpo": Arm("gfpo", what="GFPO (shortest 8 of 16)"),
    "fbos": Arm("fbos", what="FBOS default (EPA + ECC, append, always)"),
    "fbos_epa_only": Arm("fbos", "epa_only", what="FBOS, EPA only (ECC weight 0)"),
    "fbos_adaptive_one": Arm("fbos", "adaptive_one",
                             what="FBOS, EPA adaptive trigger, 1 injection per prompt"),
    "fbos_behaviour": Arm("fbos", "behaviour", what="FBOS, f(u) with u = pi / pi_old(.|FAP)"),
    "fbos_ecc_quarter": Arm("fbos", "ecc_quarter", what="FBOS, ECC weight 0.25"),
    "fbos_alternate": Arm("fbos", "alternate", what="FBOS, EPA and ECC on alternate steps"),
    "fbos_fap_all": Arm("fbos", "fap_all", what="FBOS, FAPs from every round-1 rollout"),
    "fbos_16p_equal_steps": Arm("fbos", "prompts16", stop="steps",
                                what="FBOS, 16 prompts per step: EQUAL STEPS, ~2x rollouts"),
    "fbos_ecc_only": Arm("fbos", "ecc_only", what="FBOS, ECC only (EPA weight 0)"),
    "fbos_aggregated": Arm("fbos", "aggregated", what="FBOS with GOLF's aggregated FAP"),
}

# The pre-registered ablation of issue 16, in this order; every arm is reported.
ABLATIONS = ("grpo", "fbos", "fbos_epa_only", "fbos_adaptive_one", "fbos_behaviour",
             "fbos_ecc_quarter", "fbos_alternate", "fbos_fap_all", "fbos_16p_equal_steps")

REFERENCE = "grpo"
# round-1 successes of the group, as fbos_jax/rl/rollout.py:success_buckets names them
# (n = 8); other group sizes take the names their runs logged
FIX_BUCKETS = ("0", "1to3", "4plus")
_ROWS = "feedback/fix_rows_r1succ_"


def fix_buckets(rows_lists) -> tuple:
  """The fix-rate buckets the runs logged, by their lowest success count."""
  names = {k[len(_ROWS):] for rows in rows_lists for r in rows for k in r if k.startswith(_ROWS)}
  if not names:
    return FIX_BUCKETS
  low = lambda b: int(b.split("to")[0].replace("plus", ""))
  return tuple(sorted(names, key=low))


def arm_config_arg(arm: Arm, variant: str) -> str:
  """The config argument of an arm: ``variant`` and its flavors (``tiny_chain,fap_all``)."""
  return f"{variant},{arm.flavors}" if arm.flavors else variant


def load_config(name, arg):
  """configs/<name>.py:<arg>, through the one config loader."""
  return configs.load(f"{name}:{arg}")


def shared_setup(c, opts: Options):
  """Fields every run of the comparison shares (task, budget shape, eval set)."""
  if opts.task:
    c.data.task = opts.task
  if opts.quick:
    c.model.num_layers, c.model.hidden_size, c.model.intermediate_size = 1, 64, 128
    c.model.num_heads, c.model.num_kv_heads = 2, 1
    from fbos_jax.rl import sft as sft_lib
    sft_lib.set_total_steps(c, 20)  # with stages: each in the recipe's proportions
    c.train.eval_prompts = 16
    c.sampling.max_new_tokens = 6
  c.train.progress = False
  c.train.checkpoint_every = 0
  c.train.eval_every = 0
  for kv in opts.set:
    k, _, v = kv.partition("=")
    configs.set_field(c, k, v)
  from fbos_jax.rl import config as config_lib
  ignored = config_lib.stage_override_errors(c, [kv.partition("=")[0] for kv in opts.set])
  if ignored:  # a --set that the warm start's stages would ignore
    raise ValueError("--set: " + "; ".join(ignored))
  return c


def reference_steps(budget: int, opts: Options) -> int:
  """Steps the reference (GRPO) takes to generate ``budget`` rollouts: the
  stopping point of the equal-steps arms."""
  c = shared_setup(load_config(REFERENCE, opts.variant), opts)
  return int(math.ceil(budget / (c.rl.prompts_per_step * c.rl.group_size)))


def run_one(opts: Options, label, seed, sft_params, budget, max_steps, eval_every, *,
            learning_rate=None, valid_prompts=0):
  """One run of arm ``label`` from the warm start ``sft_params``; ``learning_rate``:
  the arm's rate (None: its config's); ``valid_prompts`` > 0: evaluated on that
  many validation problems (a sweep run) instead of the test set."""
  from fbos_jax import data as data_lib
  from fbos_jax.rl.trainer import RLTrainer
  arm, variant = ARMS[label], opts.variant
  c = shared_setup(load_config(arm.config, arm_config_arg(arm, variant)), opts)
  c.seed = seed
  c.data.shuffle_seed = 0  # the seed's data stream (trainer.data_seed): same order for every algo
  if learning_rate is not None:
    c.optim.learning_rate = float(learning_rate)
  tag = f"_lr{learning_rate:g}_valid" if valid_prompts else ""
  wd = os.path.join(opts.workdir, "runs", f"{label}_s{seed}{tag}")
  tr = RLTrainer(c, wd, init_params=sft_params)
  state = tr.init_state()
  evals = tr.eval_examples
  if valid_prompts:
    evals = data_lib.held_out_examples(c.data, valid_prompts, skip=c.train.eval_prompts,
                                       tokenizer=tr.ctx.tokenizer, templates_config=c.templates)
  used, step = 0, 0
  rows = []
  k = c.train.eval_k  # greedy pass@1, plus pass@1 at T=1 over k samples (lower variance)
  ev = tr.evaluate(state, evals, k=k, step=0)
  rows.append({"step": 0, "rollouts": 0, **ev})
  t0 = time.perf_counter()
  done = (lambda: step >= max_steps) if arm.stop == "steps" else (lambda: used >= budget)
  while not done():
    state, m = tr.train_step(state, step)
    step += 1
    used += int(m["rollouts/generated"])
    row = {"step": step, "rollouts": used,
           **{k: v for k, v in m.items() if isinstance(v, (int, float))}}
    if step % eval_every == 0 or done():
      row.update(tr.evaluate(state, evals, k=k, step=step))
    rows.append(row)
  tr.close()
  return {"label": label, "seed": seed, "rows": rows, "seconds": time.perf_counter() - t0,
          "stop": arm.stop, "config": f"configs/{arm.config}.py:{arm_config_arg(arm, variant)}",
          "learning_rate": float(c.optim.learning_rate), "budget_rollouts": budget,
          "warm_start": params_digest(sft_params),
          "eval_set": f"validation ({len(evals)} problems)" if valid_prompts else "test"}


def params_digest(params) -> str:
  """A short digest of a warm start's params (equal digests: the same warm start)."""
  import hashlib  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(params):
    h.update(np.asarray(jax.device_get(leaf)).tobytes())
  return h.hexdigest()[:16]


def identity(opts: Options, budget: int, eval_every: int) -> dict:
  """Everything that decides a comparison's runs, besides the seeds: a --resume
  keeps earlier runs only when this is unchanged (checked before any training)."""
  return {"variant": opts.variant, "arms": {l: dataclasses.asdict(ARMS[l]) for l in opts.arms},
          "budget_rollouts": budget, "eval_every": eval_every, "task": opts.task,
          "set": sorted(opts.set), "quick": opts.quick,
          "shared_warm_start": opts.shared_warm_start, "lrs": [float(x) for x in opts.lrs],
          "sweep_seed": opts.sweep_seed, "valid_prompts": opts.valid_prompts}


def _final(rows, key):
  vals = [r[key] for r in rows if key in r]
  return vals[-1] if vals else float("nan")


def _mean_over(rows, key, fallback=None):
  vals = [r[key] for r in rows if key in r and r["step"] > 0]
  if not vals and fallback:
    return _mean_over(rows, fallback)
  return float(np.mean(vals)) if vals else float("nan")


def _pooled(rows, rate, count):
  """A per-step rate pooled over steps, weighted by its per-step row count."""
  num = sum(r[rate] * r.get(count, 0) for r in rows if rate in r and r["step"] > 0)
  den = sum(r.get(count, 0) for r in rows if rate in r and r["step"] > 0)
  return float(num / den) if den else float("nan")


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


def _stat(xs):
  xs = np.asarray(xs, float)
  if np.all(np.isnan(xs)):
    return {"mean": float("nan"), "std": float("nan")}
  return {"mean": float(np.nanmean(xs)), "std": float(np.nanstd(xs))}


def summarize(results, sft_len, budget=None):
  """The comparison's table, per arm (``{}`` while only sweep runs have finished)."""
  labels = list(dict.fromkeys(r["label"] for r in results))
  if not labels:
    return {}
  by = {l: [r for r in results if r["label"] == l] for l in labels}
  base = next((b for b in (REFERENCE, "fbos") if b in by), labels[0])  # the reference run
  base_final = float(np.mean([_final(r["rows"], "eval/accuracy") for r in by[base]]))
  base_len = float(np.mean([_mean_over(r["rows"], "response/length") for r in by[base]]))
  buckets = fix_buckets([r["rows"] for r in results])
  table = {}
  for l, runs in by.items():
    rows_of = [r["rows"] for r in runs]
    fin = [_final(r, "eval/accuracy") for r in rows_of]
    fin_s = [_final(r, "eval/pass@1_sampled") for r in rows_of]
    b = budget or max(r[-1]["rollouts"] for r in rows_of)
    auc = [mean_accuracy_over_budget(r, b) for r in rows_of]
    reach = [rollouts_to_reach(r, base_final) for r in rows_of]
    base_reach = [rollouts_to_reach(r["rows"], base_final) for r in by[base]]
    mean = lambda key, fb=None: [_mean_over(r, key, fb) for r in rows_of]
    ln = mean("response/length")
    elr = float("nan")
    if base_len - sft_len != 0:
      elr = float((base_len - np.mean(ln)) / (base_len - sft_len))
    # n/a when no seed reached it, or when it was reached at the warm start (0 rollouts)
    reached = [x for x in reach if np.isfinite(x)]
    ratio = (float(np.nanmean(base_reach) / np.mean(reached))
             if reached and np.mean(reached) > 0 else float("nan"))
    t = {"final_accuracy": _stat(fin), "final_sampled_accuracy": _stat(fin_s),
         "mean_accuracy_over_budget": _stat(auc), "rollouts_to_grpo_final": _stat(reach),
         "sample_efficiency_vs_grpo": ratio,
         "entropy": _stat(mean("policy/entropy")),
         # the round-1 rows on q only (EPA's appended off-policy rows excluded);
         # runs logged before the metric existed fall back to the batch entropy: n/a
         "entropy_onpolicy": _stat(mean("policy/entropy_onpolicy")),
         "grad_norm": _stat(mean("policy/grad_norm")),
         "grad_norm_epa": _stat(mean("grad_norm/epa")),
         "grad_norm_ecc": _stat(mean("grad_norm/ecc")),
         "response_length": _stat(ln), "all_equal_groups": _stat(mean("groups/all_equal_frac")),
         "all_fail_groups": _stat(mean("groups/all_fail_frac")),
         "fap_truncated": _stat(mean("fap/truncated_frac")),
         "fix_rate": _stat(mean("feedback/fix_rate")),
         "fix_rate_pooled": _stat([_pooled(r, "feedback/fix_rate", "feedback/fix_rows")
                                   for r in rows_of]),
         "resample_rate": _stat([_pooled(r, "feedback/resample_rate", "feedback/fix_rows")
                                 for r in rows_of]),
         "injected_per_step": _stat(mean("epa/injected")),
         "excess_length_reduction": elr,
         "reached_grpo_final": int(np.sum(~np.isnan(reach))), "seeds": len(runs),
         "reference": base, "stop": runs[0].get("stop", "rollouts"),
         "rollouts_used": _stat([r[-1]["rollouts"] for r in rows_of]),
         "steps": _stat([r[-1]["step"] for r in rows_of]),
         "seconds": _stat([r.get("seconds", float("nan")) for r in runs])}
    t["fix_buckets"] = buckets
    for bucket in buckets:
      t[f"fix_rate_r1succ_{bucket}"] = _stat(
          [_pooled(r, f"feedback/fix_rate_r1succ_{bucket}", f"feedback/fix_rows_r1succ_{bucket}")
           for r in rows_of])
    table[l] = t
  return table


def _f(s, p=3):
  return "n/a" if not np.isfinite(s["mean"]) else f"{s['mean']:.{p}f} ± {s['std']:.{p}f}"


def _label(l, t):
  return f"{l} (EQUAL STEPS)" if t.get("stop") == "steps" else l


def markdown(table):
  ref = next(iter(table.values()))["reference"] if table else "grpo"
  ref = "GRPO" if ref == "grpo" else ref
  lines = [f"| run | final acc (greedy) | final acc (T=1) | mean acc over budget | rollouts to {ref}'s final acc | sample eff. vs {ref} | entropy | grad norm | length | ELR | fix rate | all-equal groups |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for l, t in table.items():
    eff = t["sample_efficiency_vs_grpo"]
    elr = t["excess_length_reduction"]
    lines.append(
        f"| {_label(l, t)} | {_f(t['final_accuracy'])} | {_f(t['final_sampled_accuracy'])} "
        f"| {_f(t['mean_accuracy_over_budget'])} "
        f"| {_f(t['rollouts_to_grpo_final'], 0)} "
        f"({t['reached_grpo_final']}/{t['seeds']}) | {'n/a' if not np.isfinite(eff) else f'{eff:.2f}x'} "
        f"| {_f(t['entropy'])} | {_f(t['grad_norm'])} | {_f(t['response_length'], 2)} "
        f"| {'n/a' if not np.isfinite(elr) else f'{100 * elr:.0f}%'} | {_f(t['fix_rate'])} "
        f"| {_f(t['all_equal_groups'])} |")
  return "\n".join(lines)


def diagnostics_markdown(table):
  """The claims' diagnostics: on-policy entropy, per-term gradient norms, the fix
  rate (pooled over steps' rows) next to the resample rate (the same rows'
  prompts' round-1 success rate: what sampling q again gives) and per round-1
  success bucket, all-fail groups, FAP cuts."""
  buckets = next(iter(table.values())).get("fix_buckets", FIX_BUCKETS) if table else FIX_BUCKETS
  zero = "".join(f" fix rate, r1 succ {b} |" for b in buckets)
  lines = ["| run | stop | rollouts | steps | entropy (on-policy round 1) | entropy (batch) "
           "| grad norm (total) | grad norm EPA | grad norm ECC | fix rate | resample rate |" + zero
           + " all-fail groups | FAPs cut | injected/step | minutes |",
           "|" + "---|" * (15 + len(buckets))]
  for l, t in table.items():
    fixes = "".join(f" {_f(t.get(f'fix_rate_r1succ_{b}', _stat([])))} |" for b in buckets)
    sec = t.get("seconds", {"mean": float("nan"), "std": float("nan")})
    lines.append(
        f"| {_label(l, t)} | {'equal steps' if t.get('stop') == 'steps' else 'equal rollouts'} "
        f"| {_f(t['rollouts_used'], 0)} | {_f(t['steps'], 0)} | {_f(t['entropy_onpolicy'])} "
        f"| {_f(t['entropy'])} | {_f(t['grad_norm'])} | {_f(t['grad_norm_epa'])} "
        f"| {_f(t['grad_norm_ecc'])} | {_f(t.get('fix_rate_pooled', t['fix_rate']))} "
        f"| {_f(t.get('resample_rate', _stat([])))} |{fixes} {_f(t['all_fail_groups'])} "
        f"| {_f(t['fap_truncated'])} | {_f(t['injected_per_step'], 1)} "
        f"| {_f({k: v / 60 for k, v in sec.items()}, 1)} |")
  return "\n".join(lines)


def probe_markdown(probes: dict) -> str:
  """The warm starts measured before any RL step (``--probe_batches``)."""
  if not probes:
    return ""
  probes = {s: {k: v for k, v in p.items() if k != "feedback_probe"} for s, p in probes.items()}
  first = next(iter(probes.values()))
  keys = (["reward/round1_solved", "groups/all_fail_frac", "groups/all_equal_frac",
           "fap/truncated_frac", "fix_rate", "resample_rate"]
          + [k for k in first if k.startswith("fix_rate_r1succ_")])
  lines = ["| warm start | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
  for seed, p in sorted(probes.items()):
    lines.append(f"| seed {seed} ({p.get('batches', '?')} batches) | "
                 + " | ".join("n/a" if not np.isfinite(p.get(k, float("nan"))) else f"{p[k]:.3f}"
                              for k in keys) + " |")
  return "\n".join(lines)


def _series(rows, key, fallback=None):
  pts = [(r, r[key]) for r in rows if key in r]
  if not pts and fallback:
    pts = [(r, r[fallback]) for r in rows if fallback in r]
  return pts


def plot(results, out_png, title=""):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  panels = [("rollouts", "eval/accuracy", None, "held-out accuracy (greedy) vs rollouts"),
            ("rollouts", "eval/pass@1_sampled", None, "held-out accuracy (T=1, mean of k) vs rollouts"),
            ("step", "eval/accuracy", None, "held-out accuracy (greedy) vs update steps"),
            ("rollouts", "reward/round1", None, "training reward (round 1)"),
            ("rollouts", "policy/entropy_onpolicy", None, "entropy, on-policy round-1 rows"),
            ("rollouts", "policy/entropy", None, "entropy, whole EPA batch"),
            ("rollouts", "policy/grad_norm", None, "gradient norm (total)"),
            ("rollouts", "grad_norm/epa", None, "gradient norm, EPA term"),
            ("rollouts", "grad_norm/ecc", None, "gradient norm, ECC term"),
            ("rollouts", "feedback/fix_rate", None, "fix rate (round 2 fixes a failure)"),
            ("rollouts", "feedback/fix_rate_r1succ_0", None, "fix rate, groups with 0 round-1 successes"),
            ("rollouts", "groups/all_fail_frac", None, "all-fail groups (no GRPO signal)")]
  fig, axes = plt.subplots(3, 4, figsize=(22, 13))
  labels = list(dict.fromkeys(r["label"] for r in results))
  colors = {l: f"C{i % 10}" for i, l in enumerate(labels)}
  styles = {l: ("--" if i >= 10 else "-") for i, l in enumerate(labels)}
  for ax, (x, y, fb, ttl) in zip(axes.flat, panels):
    for l in labels:
      runs = [r for r in results if r["label"] == l]
      name = f"{l} (equal steps)" if runs[0].get("stop") == "steps" else l
      for i, r in enumerate(runs):
        pts = _series(r["rows"], y, fb)
        if pts:
          xs, ys = zip(*[(row[x], v) for row, v in pts])
          ax.plot(xs, ys, color=colors[l], ls=styles[l], alpha=0.35 if len(runs) > 1 else 1.0,
                  marker="o" if len(xs) < 3 else None, label=name if i == 0 else None)
      # mean curve over seeds (on the first seed's x grid for eval curves)
      if len(runs) > 1 and y.startswith("eval/"):
        grids = [[row[y] for row in r["rows"] if y in row] for r in runs]
        n = min(len(g) for g in grids)
        xs = [row[x] for row in runs[0]["rows"] if y in row][:n]
        ax.plot(xs, np.mean([g[:n] for g in grids], 0), color=colors[l], ls=styles[l], lw=2.5)
    ax.set_title(ttl, fontsize=10)
    ax.set_xlabel(x)
    ax.grid(alpha=0.3)
  axes.flat[0].legend(fontsize=7)
  if title:
    fig.suptitle(title, fontsize=9)
  fig.tight_layout(rect=(0, 0, 1, 0.97) if title else None)
  fig.savefig(out_png, dpi=80)
  plt.close(fig)


def machine_state() -> dict:
  """The machine the runs shared: CPU count and load averages (1, 5, 15 min)."""
  try:
    load = os.getloadavg()
  except OSError:
    load = (float("nan"),) * 3
  return {"cpus": os.cpu_count(), "load_avg": [round(x, 2) for x in load],
          "host": platform.node(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def select_arms(arms: list, ablations: bool, algos: list) -> list:
  """The arm labels a comparison runs: ``arms`` (``--arms``) if any, else
  :data:`ABLATIONS` (``--ablations``), else ``algos`` (``--algos``)."""
  if arms:
    bad = [a for a in arms if a not in ARMS]
    if bad:
      raise FlagError(f"unknown arm(s) {bad}; known: {sorted(ARMS)}")
    return list(arms)
  if ablations:
    return list(ABLATIONS)
  out = []
  for a in algos:
    if a not in ARMS:
      raise FlagError(f"unknown algorithm {a!r}; known arms: {sorted(ARMS)}")
    out.append(a)
  return out


def probe_warm_start(trainer, params, batches: int) -> dict:
  """Round 1 and a FAP round 2 (``fap_mode=single``) on ``batches`` training
  batches, no update: rates averaged over batches, fix rates pooled over rows."""
  import jax
  from fbos_jax.rl import rounds
  rows = [rounds.probe_step(trainer.ctx, params, next(trainer.train_iter),
                            jax.random.fold_in(jax.random.key(2024), s), fap_mode="single")
          for s in range(batches)]
  out = {"batches": batches}
  for k in ("reward/round1_solved", "groups/all_fail_frac", "groups/all_equal_frac",
            "fap/truncated_frac"):
    out[k] = float(np.mean([r[k] for r in rows]))
  pooled = lambda rate, cnt: (sum(r.get(rate, 0.0) * r.get(cnt, 0) for r in rows)
                              / max(sum(r.get(cnt, 0) for r in rows), 1))
  out["fix_rate"] = pooled("feedback/fix_rate", "feedback/fix_rows")
  # the same rows' prompts resampled on q (their round-1 success rate): the baseline
  out["resample_rate"] = pooled("feedback/resample_rate", "feedback/fix_rows")
  out["fix_rows"] = int(sum(r.get("feedback/fix_rows", 0) for r in rows))
  for b in fix_buckets([rows]):
    n = sum(r.get(f"feedback/fix_rows_r1succ_{b}", 0) for r in rows)
    out[f"fix_rate_r1succ_{b}"] = (pooled(f"feedback/fix_rate_r1succ_{b}",
                                          f"feedback/fix_rows_r1succ_{b}") if n else float("nan"))
    out[f"fix_rows_r1succ_{b}"] = int(n)
  return out


def jax_key(seed: int):
  import jax
  return jax.random.key(seed)


def feedback_probe_markdown(probes: dict) -> str:
  """The feedback-reading probe of each warm start (``--feedback_probe``)."""
  from fbos_jax.rl import probe as probe_lib
  got = {f"seed {s}": p["feedback_probe"] for s, p in sorted(probes.items())
         if "feedback_probe" in p}
  return probe_lib.markdown(got) if got else ""


def warm_starts(opts: Options, seeds: list) -> tuple:
  """The warm start of each seed (trained once, cached), its held-out accuracy
  and its probe: ({seed: params}, {seed: eval}, {seed: probe})."""
  from fbos_jax.rl import sft as sft_lib
  from fbos_jax.rl.trainer import RLTrainer
  params, evals, probes = {}, {}, {}
  for seed in ([0] if opts.shared_warm_start else seeds):
    cfg = shared_setup(load_config(REFERENCE, opts.variant), opts)
    cfg.seed = seed
    tag = "" if opts.shared_warm_start else f"_s{seed}"
    tr = RLTrainer(cfg, os.path.join(opts.workdir, f"warm_start{tag}"))
    p, cached = sft_lib.warm_start(cfg, tr.ctx, tr.init_state(),
                                   cache_dir=os.path.join(opts.workdir, f"sft{tag}"))
    ev = tr.evaluate(p, tr.eval_examples, k=cfg.train.eval_k)
    print(f"warm start (seed {seed}): held-out accuracy {ev['eval/accuracy']:.3f} (greedy), "
          f"{ev.get('eval/pass@1_sampled', float('nan')):.3f} (T=1), "
          f"length {ev['eval/length']:.2f} ({'cached' if cached else 'trained'})", flush=True)
    if opts.probe_batches > 0:
      probes[seed] = probe_warm_start(tr, tr.policy(p), opts.probe_batches)
      print(f"warm start (seed {seed}) probe: {json.dumps(probes[seed])}", flush=True)
      if opts.feedback_probe:
        from fbos_jax.rl import probe as probe_lib
        t0 = time.perf_counter()
        fp = probe_lib.run_probe(tr.ctx, tr.policy(p), lambda: next(tr.train_iter), opts.probe_batches,
                                 key=jax_key(4048 + seed))
        fp["seconds"] = time.perf_counter() - t0
        probes[seed]["feedback_probe"] = fp
        print(f"warm start (seed {seed}) feedback-reading probe:\n"
              + probe_lib.markdown({f"seed {seed}": fp}), flush=True)
    tr.close()
    params[seed], evals[seed] = p, ev
  if opts.shared_warm_start:
    params = {s: params[0] for s in seeds}
    evals = {s: evals[0] for s in seeds}
  return params, evals, probes


def resummarize(workdir: str):
  """compare.md, compare.png and the table of ``workdir/compare.json`` rebuilt from
  the runs it holds (no training)."""
  with open(os.path.join(workdir, "compare.json")) as f:
    data = json.load(f)
  write_outputs(workdir, data["runs"], data["warm_start"], data["budget_rollouts"], data["seeds"],
                data["wall_seconds"], meta={k: data[k] for k in ("command", "note", "machine",
                                                                "variant", "arms", "probes",
                                                                "warm_starts", "equal_steps",
                                                                "partial", "resumed",
                                                                "identity", "sweep",
                                                                "learning_rates",
                                                                "sweep_runs")
                                            if k in data})


def write_probe_only(workdir: str, meta: dict, probes: dict, sft_evals: dict) -> None:
  """``--probe_only``'s outputs: WORKDIR/probe.json (``meta``, the probes) and probe.md
  (the warm starts, the probe tables), the tables printed too."""
  meta["machine"]["end"] = machine_state()
  with open(os.path.join(workdir, "probe.json"), "w") as f:
    json.dump(meta, f, indent=1, default=float)
  md = probe_markdown({s: {k: v for k, v in p.items() if k != "feedback_probe"}
                       for s, p in probes.items()})
  fb = feedback_probe_markdown(probes)
  with open(os.path.join(workdir, "probe.md"), "w") as f:
    f.write(f"Command: `{meta['command']}`\n\nWarm starts: "
            + "; ".join(f"seed {s}: greedy {e['eval/accuracy']:.3f}, T=1 "
                        f"{e.get('eval/pass@1_sampled', float('nan')):.3f}"
                        for s, e in sorted(sft_evals.items()))
            + f"\n\n{md}\n\nFeedback-reading probe:\n\n{fb}\n")
  print(md)
  print(fb)


def run(opts: Options, command: str):
  """The comparison ``opts`` asks for (``command``: its command line, recorded in
  every output): the warm starts and their probes, the sweep (``opts.lrs``), then
  every arm's seeds, written to ``opts.workdir`` after every run. A request it
  refuses raises :class:`FlagError` before any training."""
  t_start = time.perf_counter()
  os.makedirs(opts.workdir, exist_ok=True)
  labels = list(opts.arms)
  seeds = list(range(1 if opts.quick else opts.seeds))
  meta = {"command": command,
          "note": opts.note, "machine": {"start": machine_state()}, "variant": opts.variant,
          "arms": {l: dataclasses.asdict(ARMS[l]) for l in labels}}
  base_cfg = shared_setup(load_config(REFERENCE, opts.variant), opts)
  budget = opts.budget or (64 if opts.quick else 128 * base_cfg.train.steps)
  eval_every = opts.eval_every or (2 if opts.quick else 5)
  max_steps = reference_steps(budget, opts)
  meta["equal_steps"] = max_steps
  meta["identity"] = identity(opts, budget, eval_every)
  lrs = [float(x) for x in opts.lrs]
  if lrs and opts.sweep_seed not in seeds:
    raise FlagError(f"--sweep_seed={opts.sweep_seed} is not one of the seeds {seeds}")
  if lrs and base_cfg.train.eval_k < 2:
    raise FlagError("--lrs: the sweep picks on the T=1 accuracy, which needs "
                    f"train.eval_k >= 2 (it is {base_cfg.train.eval_k})")
  # before any training: a --resume of another comparison is refused here
  results, sweep_runs = (resumed_runs(opts.workdir, meta, labels, seeds) if opts.resume
                         else ([], []))
  sft_params, sft_evals, probes = warm_starts(opts, seeds)
  meta["probes"] = {str(k): v for k, v in probes.items()}
  meta["warm_starts"] = {str(k): v for k, v in sft_evals.items()}
  if opts.probe_only:
    write_probe_only(opts.workdir, meta, probes, sft_evals)
    return
  t_start -= meta.get("resumed", {}).get("wall_seconds_before", 0.0)  # wall of the whole comparison
  valid_n = opts.valid_prompts or base_cfg.train.eval_prompts
  from tqdm.auto import tqdm

  def save(partial=None):
    meta["sweep"], meta["learning_rates"] = sweep_table(sweep_runs, labels, lrs)
    meta["sweep_runs"] = sweep_runs
    meta["machine"]["end"] = machine_state()
    write_outputs(opts.workdir, results, sft_evals[seeds[0]], budget, len(seeds),
                  time.perf_counter() - t_start,
                  meta=dict(meta, partial=partial) if partial else meta, quiet=bool(partial))

  # 1. the sweep (docs/results/verdict_rule.md): one seed per rate and arm, on the
  # validation split; 2. each arm's seeds at its pick (its config's rate without --lrs)
  todo = [(l, lr) for l in labels for lr in lrs
          if not any(r["label"] == l and r["learning_rate"] == lr for r in sweep_runs)]
  total = len(labels) * (len(lrs) + len(seeds))
  bar = tqdm(todo, desc="compare: sweep", dynamic_ncols=True)
  for label, lr in bar:
    bar.set_postfix(run=f"{label} lr {lr:g}")
    sweep_runs.append(run_one(opts, label, opts.sweep_seed, sft_params[opts.sweep_seed],
                              budget, max_steps, eval_every, learning_rate=lr,
                              valid_prompts=valid_n))
    save(partial=f"{len(sweep_runs) + len(results)} of {total} runs")
  _, picks = sweep_table(sweep_runs, labels, lrs)
  for label in labels:
    if lrs and picks[label] is None:
      logging.warning("%s: no stable learning rate among %s (every one drops more than %.2f "
                      "greedy in its first %d rollouts): the arm is not run", label, lrs,
                      verdict_lib.MAX_DROP, verdict_lib.DROP_WINDOW)
  done_runs = {(r["label"], r["seed"]) for r in results}
  bar = tqdm([(l, s) for s in seeds for l in labels
              if (l, s) not in done_runs and (not lrs or picks[l] is not None)],
             desc="compare", dynamic_ncols=True)
  for label, seed in bar:
    bar.set_postfix(run=f"{label} s{seed}")
    res = run_one(opts, label, seed, sft_params[seed], budget, max_steps, eval_every,
                  learning_rate=picks[label] if lrs else None)
    results.append(res)
    logging.info("%s seed %d: final acc %.3f in %.0fs", label, seed,
                 _final(res["rows"], "eval/accuracy"), res["seconds"])
    # a long comparison keeps what it has so far (the last save below drops the label)
    save(partial=f"{len(sweep_runs) + len(results)} of {total} runs")
  save()


def resumed_runs(workdir, meta, labels, seeds) -> tuple:
  """The finished runs of ``workdir/compare.json`` that this comparison would run
  again, as (runs, sweep runs); ``meta`` records which were kept. Refuses a file of
  another comparison, naming what differs: any field of its identity
  (:func:`identity`: variant, budget, --set, --task, the sweep, ...) or an arm
  defined differently. Called before any training."""
  path = os.path.join(workdir, "compare.json")
  if not os.path.exists(path):
    raise FlagError(f"--resume: {path} does not exist")
  try:
    old = compare_file.read_json(path)
  except compare_file.CompareError as e:
    raise FlagError(f"--resume: {e}") from None
  if not isinstance(old, dict) or not isinstance(old.get("runs"), list):
    raise FlagError(f"--resume: {path} has no 'runs' list (is it a compare.json of "
                     "launch/compare.py?)")
  was, now = old.get("identity"), meta["identity"]
  if was is None:
    raise FlagError(f"--resume: {path} records no identity (written by an older "
                     "compare.py), so its runs cannot be matched to this command; "
                     "use a new --workdir")
  for field in sorted(set(was) | set(now)):
    if field != "arms" and was.get(field) != now.get(field):
      raise FlagError(f"--resume: {path} was run with {field}={was.get(field)!r}, this "
                       f"command has {field}={now.get(field)!r}; its runs would not be "
                       "comparable (use a new --workdir)")
  for label in labels:
    if label in was["arms"] and was["arms"][label] != now["arms"][label]:
      raise FlagError(f"--resume: arm {label!r} in {path} is defined differently now")
  kept = [r for r in old["runs"] if isinstance(r, dict) and r.get("label") in labels
          and r.get("seed") in seeds]
  if kept:  # what the verdict would refuse is not kept (the file, run and key named)
    try:
      compare_file.check_compare({"runs": kept, "budget_rollouts": old.get("budget_rollouts")},
                                 path, sampled=False)
    except compare_file.CompareError as e:
      raise FlagError(f"--resume: a finished run cannot be kept: {e}; use a new "
                       "--workdir (or remove that run from the file)") from None
  sweep = [r for r in old.get("sweep_runs", []) if r["label"] in labels]
  meta["resumed"] = {"from": old.get("command"), "wall_seconds_before": old["wall_seconds"],
                     "kept_runs": [f"{r['label']} s{r['seed']}" for r in kept]
                                  + [f"{r['label']} lr {r['learning_rate']:g} (sweep)"
                                     for r in sweep]}
  logging.info("--resume: keeping %d finished runs and %d sweep runs from %s", len(kept),
               len(sweep), path)
  return kept, sweep


def sweep_table(sweep_runs: list, labels: list, lrs: list) -> tuple:
  """Each arm's sweep (``{label: {rate: final accuracies, drop, stable}}``, the
  validation runs that finished) and its pick (``{label: rate or None}``; an arm
  whose sweep is incomplete has no entry)."""
  table, picks = {}, {}
  for label in labels:
    runs = {r["learning_rate"]: r for r in sweep_runs if r["label"] == label}
    entry = {}
    for lr, r in sorted(runs.items()):
      drop = evaluation.drop_from_start(r["rows"], within_rollouts=verdict_lib.DROP_WINDOW)
      entry[f"{lr:g}"] = {"final_greedy": _final(r["rows"], "eval/accuracy"),
                          "final_sampled": _final(r["rows"], "eval/pass@1_sampled"),
                          "drop_greedy": drop["greedy"], "drop_sampled": drop["sampled"],
                          "stable": drop["greedy"] >= -verdict_lib.MAX_DROP - 1e-9}
    if entry:
      table[label] = entry
    if all(lr in runs for lr in lrs):
      picks[label] = pick_learning_rate(entry)
  return table, picks


def pick_learning_rate(sweep: dict, *, max_drop: float = verdict_lib.MAX_DROP):
  """The rate of a sweep (``{rate: {"final_sampled", "drop_greedy"}}``, one
  validation run each) with the best final T=1 accuracy among the stable ones
  (greedy drop no deeper than ``max_drop``); ties go to the smaller rate. None
  when every rate is unstable: the arm is reported as such, never given a rate."""
  stable = [(float(lr), r) for lr, r in sweep.items() if r["drop_greedy"] >= -max_drop - 1e-9]
  if not stable:
    return None
  best = max(r["final_sampled"] for _, r in stable)
  return min(lr for lr, r in stable if r["final_sampled"] >= best - 1e-12)


def write_outputs(workdir, results, sft_eval, budget, seeds, wall, meta=None, quiet=False):
  """``workdir``/compare.json (all numbers), compare.md (the tables) and compare.png. While a
  comparison runs, they are rewritten after every run with ``meta["partial"]``
  ("3 of 27 runs"), which the outputs state; ``quiet``: print nothing."""
  meta = dict(meta or {})
  table = summarize(results, sft_eval["eval/length"], budget)
  out = {"budget_rollouts": budget, "seeds": seeds, "warm_start": sft_eval, "wall_seconds": wall,
         **meta, "table": table, "runs": results}
  with open(os.path.join(workdir, "compare.json"), "w") as f:
    json.dump(out, f, indent=1, default=float)
  machine = meta.get("machine", {})
  load = lambda k: machine.get(k, {}).get("load_avg", "?")
  header = [f"Command: `{meta.get('command', '?')}`",
            f"Machine: {machine.get('start', {}).get('cpus', '?')} CPUs; load average "
            f"(1/5/15 min) {load('start')} at the start, {load('end')} at the end. "
            f"Shared with: {meta.get('note') or '(no --note given)'}",
            f"Variant `{meta.get('variant', '?')}`; budget: {budget} generated rollouts per run "
            f"(equal-steps arms: {meta.get('equal_steps', '?')} steps, the reference's count); "
            f"{seeds} seed(s); warm start (seed 0) accuracy {sft_eval['eval/accuracy']:.3f} "
            f"(greedy), {sft_eval.get('eval/pass@1_sampled', float('nan')):.3f} (T=1); "
            f"wall time {wall / 60:.1f} min."]
  if meta.get("partial"):
    header.insert(0, f"**PARTIAL: {meta['partial']} so far** (the comparison was still running "
                     "or was stopped; the seeds and arms below are those that finished).")
  if meta.get("resumed"):
    header.append(f"Resumed (`--resume`) after a stop: kept {', '.join(meta['resumed']['kept_runs'])}"
                  " from the first invocation; the wall time includes both.")
  arms = meta.get("arms", {})
  if arms:
    header.append("Arms: " + "; ".join(
        f"`{l}` = configs/{a['config']}.py:{meta.get('variant', 'tiny')}"
        f"{',' + a['flavors'] if a['flavors'] else ''} ({a['what']}; "
        f"{'EQUAL STEPS, not equal rollouts' if a['stop'] == 'steps' else 'equal rollouts'})"
        for l, a in arms.items()) + ". Every arm that ran is reported.")
  if meta.get("learning_rates") is not None and meta.get("identity", {}).get("lrs"):
    header.append("Learning rates from the sweep (one seed, validation split; "
                  "docs/results/verdict_rule.md): " + "; ".join(
                      f"`{l}` {'none stable: not run' if lr is None else f'{lr:g}'}"
                      for l, lr in meta["learning_rates"].items()))
  md = markdown(table)
  diag = diagnostics_markdown(table)
  probe = probe_markdown({int(k): v for k, v in meta.get("probes", {}).items()})
  with open(os.path.join(workdir, "compare.md"), "w") as f:
    f.write("\n\n".join(header) + f"\n\n{md}\n\nDiagnostics (means over steps; fix rates "
            f"pooled over round-2 rows per run; ± over seeds):\n\n{diag}\n")
    if probe:
      f.write(f"\nWarm starts before RL (``--probe_batches``):\n\n{probe}\n")
    fb = feedback_probe_markdown({int(k): v for k, v in meta.get("probes", {}).items()})
    if fb:
      f.write(f"\nFeedback-reading probe of the warm starts:\n\n{fb}\n")
  title = (f"{meta.get('command', '')}\nshared with: {meta.get('note') or '(no --note)'}; "
           f"load {load('start')} -> {load('end')}; equal-steps arms stop at "
           f"{meta.get('equal_steps', '?')} steps")
  if meta.get("partial"):
    title = f"PARTIAL ({meta['partial']}): " + title
  plot(results, os.path.join(workdir, "compare.png"), title=title)
  if quiet:
    return
  print(md)
  print(diag)
  print(f"wall time: {wall / 60:.1f} min; files in {workdir}")

