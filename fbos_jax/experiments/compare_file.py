"""A comparison's record, ``compare.json`` (written by ``launch/compare.py``),
read and checked: what ``launch/verdict.py`` judges and what
``launch/compare.py --resume`` keeps."""
import json
import math

GREEDY, SAMPLED = "eval/accuracy", "eval/pass@1_sampled"


class CompareError(ValueError):
  """A compare.json that cannot be judged; the message names the file, run and key."""


def load_compare(path: str) -> dict:
  """``path`` (a compare.json) read (:func:`read_json`) and checked (:func:`check_compare`)."""
  data = read_json(path)
  check_compare(data, path)
  return data


def read_json(path: str):
  """``path`` parsed as JSON; a :class:`CompareError` naming the file (and the
  line and column of a truncated one) when it cannot be."""
  try:
    with open(path) as f:
      text = f.read()
  except OSError as e:
    raise CompareError(f"{path}: cannot read it ({e.strerror})") from None
  try:
    data = json.loads(text)
  except json.JSONDecodeError as e:
    raise CompareError(f"{path}: not valid JSON at line {e.lineno}, column {e.colno} ({e.msg}); "
                       f"a truncated file? ({len(text)} characters)") from None
  return data


def _number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_compare(data, path: str = "compare.json", *, sampled: bool = True):
  """Refuses what the rule cannot judge, naming the file, the run and the key:
  a run without a label, an integer seed or eval rows; an accuracy that is not a
  finite number in [0, 1]; rollouts that are not a non-decreasing count; a second
  run of the same (arm, seed); arms with different rollout budgets, or (where
  compare.json records them) different warm starts for the same seed. ``sampled``:
  an eval row must hold the sampled accuracy too (the verdict's rule reads it;
  a comparison run with train.eval_k=1 has only the greedy one)."""
  if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
    raise CompareError(f"{path}: no 'runs' list (is it a compare.json of launch/compare.py?)")
  if not data["runs"]:
    raise CompareError(f"{path}: 'runs' is empty: no run finished")
  seen, budgets, warm = {}, {}, {}
  for i, r in enumerate(data["runs"]):
    where = f"{path}: runs[{i}]"
    if not isinstance(r, dict):
      raise CompareError(f"{where} is a {type(r).__name__}, not a run")
    label, seed = r.get("label"), r.get("seed")
    if not isinstance(label, str) or not label:
      raise CompareError(f"{where}: no 'label' (the arm's name)")
    if not isinstance(seed, int) or isinstance(seed, bool):
      raise CompareError(f"{where} ({label}): 'seed' = {seed!r}, not an integer")
    name = f"{where} (arm {label!r}, seed {seed})"
    if (label, seed) in seen:
      raise CompareError(f"{name}: a second run of this arm and seed (the first is "
                         f"runs[{seen[label, seed]}]); one run per (arm, seed)")
    seen[label, seed] = i
    rows = r.get("rows")
    if not isinstance(rows, list) or not rows:
      raise CompareError(f"{name}: no 'rows' (an empty run)")
    last = 0
    for j, row in enumerate(rows):
      if not isinstance(row, dict):
        raise CompareError(f"{name}: rows[{j}] is a {type(row).__name__}, not a dict")
      for key in (GREEDY, SAMPLED):
        if key in row:
          v = row[key]
          if not _number(v) or not math.isfinite(v) or not 0.0 <= v <= 1.0:
            raise CompareError(f"{name}: rows[{j}][{key!r}] = {v!r}, not an accuracy "
                               "(a finite number in [0, 1])")
      n = row.get("rollouts")
      if not _number(n) or n < last:
        raise CompareError(f"{name}: rows[{j}]['rollouts'] = {n!r}; expected a count of "
                           f"generated rollouts, at least the previous row's {last}")
      last = n
    if not sampled and not any(GREEDY in row for row in rows):
      raise CompareError(f"{name}: no held-out eval row with {GREEDY!r}")
    if sampled and not eval_rows(rows):
      raise CompareError(f"{name}: no held-out eval row with both {GREEDY!r} and {SAMPLED!r} "
                         "(the runs need train.eval_k >= 2)")
    budget = r.get("budget_rollouts", data.get("budget_rollouts"))
    budgets.setdefault(budget, []).append(name)
    if "warm_start" in r:
      warm.setdefault(seed, {}).setdefault(r["warm_start"], []).append(name)
  if len(budgets) > 1:
    raise CompareError(f"{path}: the arms used different rollout budgets: " + "; ".join(
        f"{b} for {', '.join(n)}" for b, n in budgets.items()))
  for seed, digests in warm.items():
    if len(digests) > 1:
      raise CompareError(f"{path}: seed {seed}'s runs started from different warm starts: "
                         + "; ".join(f"{d} for {', '.join(n)}" for d, n in digests.items()))


def eval_rows(rows: list) -> list:
  """The rows of a run's held-out evals (both accuracies)."""
  return [r for r in rows if GREEDY in r and SAMPLED in r]
