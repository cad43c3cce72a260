"""The pre-registered verdict of a comparison (``docs/results/verdict_rule.md``),
the library of ``launch/verdict.py``.

:func:`verdict` judges a ``compare.json`` (read and checked by
:mod:`fbos_jax.experiments.compare_file`): per arm and seed, the final held-out
greedy and sampled accuracy, generated rollouts, the rollouts at the first eval
where the run's sampled accuracy reached the reference's final sampled accuracy
of the same seed, the mean on-policy entropy and gradient norm; then each claim
per arm, called by the rule. :func:`write` puts it in ``verdict.json``,
``verdict.md`` (:func:`markdown`) and ``verdict.png`` (:func:`plot`: held-out
accuracy against generated rollouts, mean over seeds with the seeds' range).

The rule, for a quantity x of an arm against the reference (GRPO): the paired
difference d = mean_s(x_arm - x_ref) over the seeds, its noise band 2 x SE with
SE = sd_s(x_arm - x_ref) / sqrt(#seeds); a claim is called only outside the band.
A comparison still running (``partial`` in compare.json) gives a verdict marked
PARTIAL over the seeds that every arm has finished.
"""
import json
import math
import os

import numpy as np

from fbos_jax.experiments import compare_file
from fbos_jax.rl import batch_kinds
from fbos_jax.rl import evaluation

GREEDY, SAMPLED = compare_file.GREEDY, compare_file.SAMPLED
SHOWN, REFUTED, NOISE = "shown", "refuted", "not separable from noise"
# The recipe's bound (docs/results/verdict_rule.md, issue 33): no arm's greedy held-out
# accuracy falls more than MAX_DROP below its warm start at any eval in its first
# DROP_WINDOW generated rollouts. A learning rate that breaks it is unstable.
MAX_DROP, DROP_WINDOW = 0.03, 2000


def _mean_of(rows: list, key: str) -> float:
  xs = [r[key] for r in rows if key in r and r.get("step", 0) > 0]
  return float(np.mean(xs)) if xs else float("nan")


def run_quantities(rows: list, ref_final_sampled: float) -> dict:
  """The rule's quantities of one run (``rows``: its compare.json rows)."""
  ev = compare_file.eval_rows(rows)
  if not ev:
    raise ValueError("a run with no held-out eval rows: nothing to judge")
  reach = next((r["rollouts"] for r in ev if r[SAMPLED] >= ref_final_sampled), None)
  return {"final_greedy": float(ev[-1][GREEDY]), "final_sampled": float(ev[-1][SAMPLED]),
          "rollouts": int(rows[-1]["rollouts"]),
          "reach_rollouts": None if reach is None else int(reach),
          "entropy_onpolicy": _mean_of(rows, "policy/entropy_onpolicy"),
          "grad_norm": _mean_of(rows, "policy/grad_norm"),
          "drop_from_start": evaluation.drop_from_start(rows, within_rollouts=DROP_WINDOW)}


# What the update did, beside the claims (issue 33, item 4): {metric key: label}.
MECHANISM = {"feedback/fix_rate_r1succ_0": "fix rate, all-fail groups",
             "feedback/fix_rate": "fix rate, failed rollouts",
             f"{batch_kinds.EPA.name}/injected": "EPA rows pulled back onto q, a step",
             f"grad_norm/{batch_kinds.EPA.name}": "EPA gradient norm",
             f"grad_norm/{batch_kinds.ECC.name}": "ECC gradient norm"}


def term_cosine(rows: list, a: str = batch_kinds.EPA.name, b: str = batch_kinds.ECC.name) -> float:
  """The mean cosine between terms ``a``'s and ``b``'s weighted gradients, from the
  norms the update logs (``grad_norm/<term>`` of each contribution, ``policy/grad_norm``
  of their sum: |g|^2 = |g_a|^2 + |g_b|^2 + 2 g_a.g_b), over the steps where exactly
  these two terms contributed; NaN when there are none (one term a step: GRPO, or
  ``objective_schedule=alternate``)."""
  cos = []
  for r in rows:
    terms = {k[len("grad_norm/"):]: v for k, v in r.items()
             if k.startswith("grad_norm/") and isinstance(v, (int, float)) and v > 0}
    if set(terms) == {a, b} and "policy/grad_norm" in r:
      g = r["policy/grad_norm"]
      cos.append((g * g - terms[a] ** 2 - terms[b] ** 2) / (2 * terms[a] * terms[b]))
  return float(np.mean(cos)) if cos else float("nan")


def mechanism(rows: list) -> dict:
  """The run's means of :data:`MECHANISM` over its training steps (None when the arm
  has no such metric) and the EPA-ECC gradient cosine (:func:`term_cosine`)."""
  out = {k: _mean_of([r for r in rows if not k.startswith("grad_norm/") or r.get(k, 0) > 0], k)
         for k in MECHANISM}  # a term's norm over the steps it trained (alternate: every other)
  out["epa_ecc_cosine"] = term_cosine(rows)
  return {k: None if math.isnan(x) else x for k, x in out.items()}  # JSON: null, not NaN


def paired(arm: list, ref: list) -> dict:
  """d = mean(arm - ref) over paired seeds and its band 2 sd / sqrt(n) (n >= 2)."""
  diff = np.asarray(arm, float) - np.asarray(ref, float)
  n = diff.size
  band = 2 * float(np.std(diff, ddof=1)) / math.sqrt(n) if n >= 2 else float("inf")
  return {"d": float(diff.mean()), "band": band, "n": int(n)}


def call_higher(p: dict, higher_is_claim: bool = True) -> str:
  d = p["d"] if higher_is_claim else -p["d"]
  return SHOWN if d > p["band"] else REFUTED if d < -p["band"] else NOISE


def claims(arm_runs: dict, ref_runs: dict) -> dict:
  """Each claim of the paper for one arm against the reference, seed-paired."""
  seeds = sorted(set(arm_runs) & set(ref_runs))
  get = lambda runs, k: [runs[s][k] for s in seeds]
  out = {"seeds": seeds}
  # 1. faster at equal rollouts
  reach_a, reach_r = get(arm_runs, "reach_rollouts"), get(ref_runs, "reach_rollouts")
  reached = [x is not None for x in reach_a]
  if not any(reached):
    c1 = {"call": REFUTED, "why": "never reached the reference's final sampled accuracy"}
  elif not all(reached):
    c1 = {"call": NOISE, "why": f"reached it on {sum(reached)} of {len(seeds)} seeds"}
  else:
    p = paired(reach_a, reach_r)
    c1 = dict(p, call=call_higher(p, higher_is_claim=False),
              why="mean reach_rollouts against the reference's own")
  out["faster_at_equal_rollouts"] = c1
  for name, key, higher in (("higher_ceiling", "final_sampled", True),
                            ("higher_ceiling_greedy", "final_greedy", True),
                            ("higher_entropy", "entropy_onpolicy", True),
                            ("lower_grad_norm", "grad_norm", False)):
    p = paired(get(arm_runs, key), get(ref_runs, key))
    out[name] = dict(p, call=call_higher(p, higher))
  return out


def verdict(data: dict, reference: str) -> dict:
  runs = {}
  for r in data["runs"]:
    runs.setdefault(r["label"], {})[r["seed"]] = r
  if reference not in runs:
    raise compare_file.CompareError(f"no run of the reference arm {reference!r} in "
                                    f"compare.json (arms: {sorted(runs)})")
  complete = sorted(set.intersection(*(set(v) for v in runs.values())))
  per = {}
  for label, by_seed in runs.items():
    per[label] = {}
    for s in complete:
      ref_final = compare_file.eval_rows(runs[reference][s]["rows"])[-1][SAMPLED]
      per[label][s] = run_quantities(by_seed[s]["rows"], ref_final)
  for label, by_seed in runs.items():
    for s in complete:
      per[label][s]["learning_rate"] = by_seed[s].get("learning_rate")
      per[label][s]["mechanism"] = mechanism(by_seed[s]["rows"])
  drops = {a: max(-(q["drop_from_start"]["greedy"] or 0.0) for q in v.values())
           for a, v in per.items() if v}
  out = {"reference": reference, "seeds": complete, "variant": data.get("variant"),
         "budget_rollouts": data.get("budget_rollouts"), "command": data.get("command"),
         "partial": data.get("partial"), "note": data.get("note"),
         "learning_rates": data.get("learning_rates"), "sweep": data.get("sweep"),
         "recipe": {"max_drop": MAX_DROP, "window_rollouts": DROP_WINDOW,
                    "largest_greedy_drop": drops,
                    "holds": all(d <= MAX_DROP + 1e-9 for d in drops.values())},
         "runs": {a: {str(s): q for s, q in v.items()} for a, v in per.items()},
         "claims": {a: claims(per[a], per[reference]) for a in per if a != reference}}
  fbos = [a for a in per if a.startswith("fbos")]
  if len(fbos) == 2:
    a, b = fbos
    p = paired([per[a][s]["final_sampled"] for s in complete],
               [per[b][s]["final_sampled"] for s in complete])
    pick = a if p["d"] > p["band"] else b if p["d"] < -p["band"] else None
    out["default_fbos"] = dict(p, arms=[a, b], pick=pick,
                               why=(f"{pick} ends higher in sampled accuracy beyond the band"
                                    if pick else "the two FBOS arms are not separable: the "
                                    "default stays as ALGORITHMS.md section 6 sets it"))
  return out


def _ms(xs) -> str:
  """mean ± sd (ddof 1) of the defined values; integers without decimals."""
  xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
  if not xs:
    return "n/a"
  f = ",.0f" if all(isinstance(x, int) for x in xs) else ".3f"
  return (f"{np.mean(xs):{f}} ± {np.std(xs, ddof=1):{f}}" if len(xs) > 1
          else f"{xs[0]:{f}}")


def markdown(v: dict) -> str:
  seeds = v["seeds"]
  lines = []
  if v.get("partial"):
    lines += [f"**PARTIAL: {v['partial']}**; the verdict below is over the seeds every "
              f"arm has finished ({seeds}).", ""]
  lines += [f"Variant `{v['variant']}`, {len(seeds)} seeds {seeds}, budget "
            f"{v['budget_rollouts']} generated rollouts per run; reference `{v['reference']}`.",
            "", f"Command: `{v['command']}`", "",
            "| arm | learning rate | final greedy | final sampled (T=1) | rollouts "
            "| reach (rollouts; seeds) | entropy on-policy | grad norm "
            f"| greedy drop in the first {DROP_WINDOW:,} rollouts (worst seed) |",
            "|---|---|---|---|---|---|---|---|---|"]
  for arm, by_seed in v["runs"].items():
    q = [by_seed[str(s)] for s in seeds]
    reach = [x["reach_rollouts"] for x in q]
    lrs = sorted({x.get("learning_rate") for x in q}, key=str)
    drop = v.get("recipe", {}).get("largest_greedy_drop", {}).get(arm)
    lines.append(
        f"| `{arm}` | {', '.join('n/a' if x is None else f'{x:g}' for x in lrs)} | "
        f"{_ms([x['final_greedy'] for x in q])} | "
        f"{_ms([x['final_sampled'] for x in q])} | {_ms([x['rollouts'] for x in q])} | "
        f"{_ms(reach)} ({sum(r is not None for r in reach)}/{len(seeds)}) | "
        f"{_ms([x['entropy_onpolicy'] for x in q])} | {_ms([x['grad_norm'] for x in q])} | "
        f"{'n/a' if drop is None else f'{-drop:+.3f}'} |")
  lines += ["", "(mean ± sd over seeds; reach: the rollouts at the first eval, step 0 "
            "included, where the run's sampled accuracy is at least the reference's final "
            "sampled accuracy of the same seed)", "",
            "Claims, each arm against the reference (d: paired mean difference; band: "
            "2 x SE over seeds):", "",
            "| arm | faster at equal rollouts | higher ceiling (sampled) | (greedy) "
            "| higher entropy | lower grad norm |", "|---|---|---|---|---|---|"]
  for arm, c in v["claims"].items():
    cell = lambda x: (f"**{x['call']}** (d {x['d']:+.3g}, band {x['band']:.3g})"
                      if "d" in x else f"**{x['call']}** ({x['why']})")
    lines.append(f"| `{arm}` | {cell(c['faster_at_equal_rollouts'])} | "
                 f"{cell(c['higher_ceiling'])} | {cell(c['higher_ceiling_greedy'])} | "
                 f"{cell(c['higher_entropy'])} | {cell(c['lower_grad_norm'])} |")
  rec = v.get("recipe")
  if rec:
    lines += ["", f"Recipe check (no arm's greedy accuracy more than {rec['max_drop']} below the "
              f"warm start at any eval in its first {rec['window_rollouts']:,} rollouts): "
              + ("**holds**" if rec["holds"] else "**FAILS** for " + ", ".join(
                  f"`{a}` ({-d:+.3f})" for a, d in rec["largest_greedy_drop"].items()
                  if d > rec["max_drop"] + 1e-9)) + "."]
  if v.get("sweep"):
    lines += ["", sweep_markdown(v["sweep"], v.get("learning_rates") or {})]
  lines += ["", mechanism_markdown(v)]
  if "default_fbos" in v:
    dfl = v["default_fbos"]
    lines += ["", f"Default FBOS config: {dfl['why']} (`{dfl['arms'][0]}` - `{dfl['arms'][1]}`: "
              f"d {dfl['d']:+.3f}, band {dfl['band']:.3f})."]
  return "\n".join(lines) + "\n"


def mechanism_markdown(v: dict) -> str:
  """What each arm's update did (:func:`mechanism`), mean ± sd over seeds."""
  cols = list(MECHANISM.items()) + [("epa_ecc_cosine", "cos(EPA, ECC gradients)")]
  lines = ["What the updates did (means over the training steps, then mean ± sd over seeds; "
           "the cosine from the logged norms of each term's gradient and of their sum):", "",
           "| arm | " + " | ".join(label for _, label in cols) + " |",
           "|---|" + "---|" * len(cols)]
  for arm, by_seed in v["runs"].items():
    cells = []
    for key, _ in cols:
      cells.append(_ms([q["mechanism"][key] for q in by_seed.values() if "mechanism" in q]))
    lines.append(f"| `{arm}` | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def sweep_markdown(sweep: dict, picked: dict) -> str:
  """The learning-rate sweep behind each arm's rate (compare.json's ``sweep``: per
  arm, per rate, the validation run's final sampled accuracy and its drop)."""
  lines = ["Learning-rate sweep (one seed, on the validation split; the pick: the best "
           "final sampled accuracy among the stable rates, ties to the smaller):", "",
           "| arm | rate | final greedy (valid) | final sampled (valid) | greedy drop | stable |",
           "|---|---|---|---|---|---|"]
  for arm, by_lr in sweep.items():
    for lr, r in sorted(by_lr.items(), key=lambda kv: float(kv[0])):
      mark = " (picked)" if picked.get(arm) is not None and float(lr) == picked[arm] else ""
      lines.append(f"| `{arm}` | {float(lr):g}{mark} | {r['final_greedy']:.3f} | "
                   f"{r['final_sampled']:.3f} | {r['drop_greedy']:+.3f} | "
                   f"{'yes' if r['stable'] else 'no'} |")
    if picked.get(arm, 0) is None:
      lines.append(f"| `{arm}` | none stable: the arm was not run | | | | |")
  return "\n".join(lines)


def plot(data: dict, v: dict, path: str):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  by = {}
  for r in data["runs"]:
    if r["seed"] in v["seeds"]:
      by.setdefault(r["label"], []).append(compare_file.eval_rows(r["rows"]))
  for ax, key, title in ((axes[0], SAMPLED, "held-out sampled accuracy (T=1)"),
                         (axes[1], GREEDY, "held-out greedy accuracy")):
    for label, evs in by.items():
      n = min(len(e) for e in evs)
      x = np.mean([[r["rollouts"] for r in e[:n]] for e in evs], 0)
      y = np.array([[r[key] for r in e[:n]] for e in evs])
      line, = ax.plot(x, y.mean(0), label=f"{label} ({len(evs)} seeds)")
      ax.fill_between(x, y.min(0), y.max(0), color=line.get_color(), alpha=0.15)
    ax.set_xlabel("generated rollouts")
    ax.set_title(title)
    ax.grid(alpha=0.3)
  axes[0].legend()
  fig.suptitle(("PARTIAL: " if v.get("partial") else "") + f"{v['variant']}: mean over seeds, "
               "band = the seeds' range")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write(data: dict, v: dict, out: str) -> str:
  """The verdict ``v`` of ``data`` (a compare.json) as ``out``/verdict.json,
  verdict.md and verdict.png; returns the markdown tables."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "verdict.json"), "w") as f:
    json.dump(v, f, indent=1)
  md = markdown(v)
  with open(os.path.join(out, "verdict.md"), "w") as f:
    f.write(f"# The {len(v['seeds'])}-seed verdict\n\n" + md)
  plot(data, v, os.path.join(out, "verdict.png"))
  return md
