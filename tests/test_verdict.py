"""The verdict (fbos_jax/experiments/verdict.py, launch/verdict.py) applies the
pre-registered rule (docs/results/verdict_rule.md) to a comparison's compare.json:
synthetic runs with known answers."""

import json
import os
import subprocess
import sys

import pytest

from fbos_jax.experiments import compare_file
from fbos_jax.experiments import verdict as V

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _verdict_cli(*args):
  return subprocess.run([sys.executable, "launch/verdict.py", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


def _run(label, seed, sampled, greedy=None, entropy=0.5, grad=1.0, per_step=128):
  """A run whose evals (every 5 steps) follow ``sampled``; step rows carry the
  entropy and gradient norm."""
  rows = []
  for i, s in enumerate(sampled):
    step = 5 * i
    if step:
      rows.append({"step": step, "rollouts": step * per_step,
                   "policy/entropy_onpolicy": entropy, "policy/grad_norm": grad})
    rows.append({"step": step, "rollouts": step * per_step, "eval/pass@1_sampled": s,
                 "eval/accuracy": (greedy or sampled)[i]})
  return {"label": label, "seed": seed, "rows": rows}


def _data(runs, partial=None):
  return {"runs": runs, "variant": "tiny_chain", "budget_rollouts": 1280,
          "command": "python launch/compare.py ...", "partial": partial}


def test_clear_gains_are_shown_and_missing_reach_is_refuted():
  runs = []
  for s, jitter in enumerate((0.0, 0.01, -0.01)):
    runs.append(_run("grpo", s, [0.2, 0.22, 0.25 + jitter], entropy=0.3 + jitter, grad=2.0))
    # FBOS: reaches GRPO's final at the first eval after the start, ends 0.1 higher,
    # keeps 0.2 more entropy, half the gradient norm
    runs.append(_run("fbos", s, [0.2, 0.3 + jitter, 0.35 + jitter], entropy=0.5 + jitter,
                     grad=1.0 + jitter))
    # never reaches it: lower everywhere
    runs.append(_run("golf", s, [0.2, 0.15, 0.1 + jitter], entropy=0.3 + 2 * jitter, grad=2.0))
  v = V.verdict(_data(runs), "grpo")
  assert v["seeds"] == [0, 1, 2]
  c = v["claims"]["fbos"]
  assert c["faster_at_equal_rollouts"]["call"] == V.SHOWN  # 640 against GRPO's 1280
  assert c["higher_ceiling"]["call"] == V.SHOWN
  assert c["higher_ceiling"]["d"] == pytest.approx(0.1)
  assert c["higher_entropy"]["call"] == V.SHOWN
  assert c["lower_grad_norm"]["call"] == V.SHOWN
  g = v["claims"]["golf"]
  assert g["faster_at_equal_rollouts"]["call"] == V.REFUTED
  assert g["higher_ceiling"]["call"] == V.REFUTED
  assert g["higher_entropy"]["call"] == V.NOISE  # mean difference 0, spread > 0
  assert v["runs"]["golf"]["0"]["reach_rollouts"] is None
  assert v["runs"]["fbos"]["1"]["reach_rollouts"] == 640


def test_reached_at_the_warm_start_counts_as_zero_rollouts_and_is_not_separable():
  """The step-0 eval counts: when the reference ends below its start, every arm
  reaches its final at 0 rollouts, and 'faster' cannot be called."""
  runs = []
  for s, j in enumerate((0.0, 0.01, 0.02)):
    runs.append(_run("grpo", s, [0.3, 0.2, 0.25 + j]))
    runs.append(_run("fbos", s, [0.3, 0.25, 0.26 + j]))
  v = V.verdict(_data(runs), "grpo")
  assert [v["runs"][a][str(s)]["reach_rollouts"] for a in ("grpo", "fbos") for s in range(3)] \
      == [0] * 6
  assert v["claims"]["fbos"]["faster_at_equal_rollouts"]["call"] == V.NOISE


def test_partial_comparison_uses_the_seeds_every_arm_finished(tmp_path):
  runs = [_run("grpo", 0, [0.2, 0.3]), _run("fbos", 0, [0.2, 0.4]), _run("grpo", 1, [0.2, 0.3])]
  v = V.verdict(_data(runs, partial="3 of 4 runs"), "grpo")
  assert v["seeds"] == [0]
  assert v["claims"]["fbos"]["higher_ceiling"]["band"] == float("inf")  # one seed: no band
  assert v["claims"]["fbos"]["higher_ceiling"]["call"] == V.NOISE
  md = V.markdown(v)
  assert md.startswith("**PARTIAL: 3 of 4 runs**")


def test_two_fbos_arms_pick_the_default_only_beyond_the_band():
  runs = []
  for s, j in enumerate((0.0, 0.01, -0.01)):
    runs.append(_run("grpo", s, [0.2, 0.25]))
    runs.append(_run("fbos", s, [0.2, 0.3 + j]))
    runs.append(_run("fbos_fap_all", s, [0.2, 0.3 - j]))
  v = V.verdict(_data(runs), "grpo")
  assert v["default_fbos"]["pick"] is None
  runs = [dict(r, rows=r["rows"]) for r in runs]
  for r in runs:
    if r["label"] == "fbos_fap_all":
      r["rows"][-1]["eval/pass@1_sampled"] += 0.2
  assert V.verdict(_data(runs), "grpo")["default_fbos"]["pick"] == "fbos_fap_all"


def test_missing_reference_is_refused_by_name():
  with pytest.raises(compare_file.CompareError, match="no run of the reference arm 'grpo'"):
    V.verdict(_data([_run("fbos", 0, [0.2, 0.3])]), "grpo")


def test_cli_writes_json_md_png(tmp_path):
  runs = [_run(a, s, [0.2, 0.3 + 0.01 * s]) for a in ("grpo", "fbos") for s in range(2)]
  (tmp_path / "compare.json").write_text(json.dumps(_data(runs)))
  out = tmp_path / "out"
  res = _verdict_cli(f"--compare={tmp_path / 'compare.json'}", f"--out={out}")
  assert res.returncode == 0, res.stderr[-3000:]
  assert "| `fbos` |" in res.stdout
  assert json.loads((out / "verdict.json").read_text())["seeds"] == [0, 1]
  assert (out / "verdict.png").stat().st_size > 0 and "| `fbos` |" in (out / "verdict.md").read_text()


# ------------------------------------------------------------- bad input (issue 34, item 1)
def _write(tmp_path, data, text=None):
  p = tmp_path / "compare.json"
  p.write_text(text if text is not None else json.dumps(data))
  return str(p)


def _good():
  return _data([_run(a, s, [0.2, 0.3]) for a in ("grpo", "fbos") for s in range(2)])


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d["runs"][1]["rows"][-1].update({"eval/accuracy": 7.5}),
     r"runs\[1\] \(arm 'grpo', seed 1\): rows\[2\]\['eval/accuracy'\] = 7.5, not an accuracy"),
    (lambda d: d["runs"][2]["rows"][0].update({"eval/pass@1_sampled": float("nan")}),
     r"runs\[2\] \(arm 'fbos', seed 0\): rows\[0\]\['eval/pass@1_sampled'\] = nan"),
    (lambda d: d["runs"][0]["rows"][0].update({"eval/accuracy": "0.4"}),
     r"rows\[0\]\['eval/accuracy'\] = '0.4', not an accuracy"),
    (lambda d: d["runs"].append(dict(d["runs"][0])),
     r"runs\[4\] \(arm 'grpo', seed 0\): a second run of this arm and seed \(the first is runs\[0\]\)"),
    (lambda d: d["runs"][3].pop("label"), r"runs\[3\]: no 'label'"),
    (lambda d: d["runs"][3].update({"rows": []}), r"runs\[3\] \(arm 'fbos', seed 1\): no 'rows'"),
    (lambda d: [r.pop("eval/pass@1_sampled", None) for r in d["runs"][0]["rows"]],
     r"runs\[0\] \(arm 'grpo', seed 0\): no held-out eval row with both"),
    (lambda d: d["runs"][2].update({"budget_rollouts": 2560}),
     r"different rollout budgets: 1280 for .*'grpo'.*; 2560 for .*runs\[2\] \(arm 'fbos'"),
    (lambda d: [r.update({"warm_start": "aaaa" if r["label"] == "grpo" else "bbbb"})
                for r in d["runs"]],
     r"seed 0's runs started from different warm starts: aaaa for .*'grpo'.*; bbbb for .*'fbos'"),
    (lambda d: d.update({"runs": []}), r"'runs' is empty"),
])
def test_impossible_comparisons_are_refused_naming_file_run_and_key(tmp_path, mutate, match):
  """Each of these was judged (exit 0) or crashed with a bare traceback before:
  an accuracy of 7.5 (d = +6.9), a NaN turned into 'refuted', a second run of
  the same arm and seed replacing the first, a string accuracy (TypeError), a run
  without a label (KeyError), an empty run, rows without the T=1 accuracy
  (IndexError), different budgets or warm starts."""
  data = _good()
  mutate(data)
  path = _write(tmp_path, data)
  with pytest.raises(compare_file.CompareError, match=match) as e:
    compare_file.load_compare(path)
  assert str(e.value).startswith(path)


def test_a_truncated_file_names_the_path_and_the_cli_exits_with_the_message(tmp_path):
  path = _write(tmp_path, None, text=json.dumps(_good())[:300])
  with pytest.raises(compare_file.CompareError,
                     match=r"compare.json: not valid JSON at line 1.*truncated"):
    compare_file.load_compare(path)
  res = _verdict_cli(f"--compare={path}", f"--out={tmp_path / 'out'}")
  assert res.returncode == 1
  assert res.stderr.strip().splitlines()[-1].startswith(
      f"launch/verdict.py: {path}: not valid JSON at line 1")


def test_the_recipe_check_reports_a_drop_beyond_the_bound_in_the_first_2000_rollouts():
  """A run that falls 0.15 below its warm start at 640 rollouts fails the recipe
  check, though it ends higher; a fall after the window does not count."""
  runs = [_run("grpo", s, [0.4, 0.25, 0.45, 0.5]) for s in range(2)]  # evals at 0, 640, ...
  runs += [_run("fbos", s, [0.4, 0.39, 0.45, 0.2]) for s in range(2)]  # 0.2 at 1920: in
  runs += [_run("golf", s, [0.4, 0.41, 0.42, 0.43, 0.1]) for s in range(2)]  # 0.1 at 2560: out
  v = V.verdict(_data(runs), "grpo")
  rec = v["recipe"]
  assert rec["largest_greedy_drop"]["grpo"] == pytest.approx(0.15)
  assert rec["largest_greedy_drop"]["fbos"] == pytest.approx(0.2)
  assert rec["largest_greedy_drop"]["golf"] == pytest.approx(0.0)
  assert not rec["holds"]
  assert v["runs"]["grpo"]["0"]["drop_from_start"]["greedy"] == pytest.approx(-0.15)
  assert "**FAILS** for `grpo` (-0.150), `fbos` (-0.200)" in V.markdown(v)


def test_the_term_cosine_comes_from_the_logged_norms():
  from fbos_jax.experiments import verdict as v
  rows = [{"step": 1, "grad_norm/epa": 3.0, "grad_norm/ecc": 4.0, "policy/grad_norm": 5.0},  # cos 0
          {"step": 2, "grad_norm/epa": 3.0, "grad_norm/ecc": 4.0, "policy/grad_norm": 7.0},  # cos 1
          {"step": 3, "grad_norm/epa": 3.0, "grad_norm/ecc": 0.0, "policy/grad_norm": 3.0}]  # one term
  assert v.term_cosine(rows) == pytest.approx(0.5)
  m = v.mechanism(rows)
  assert m["epa_ecc_cosine"] == pytest.approx(0.5)
  assert m["grad_norm/ecc"] == pytest.approx(4.0)  # over the steps the term trained
  assert m["feedback/fix_rate"] is None  # an arm without the metric: null, not NaN
  assert v.mechanism(rows[2:])["epa_ecc_cosine"] is None  # alternate / GRPO: no pair
