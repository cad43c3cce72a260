"""launch/verdict.py applies the pre-registered rule (docs/results/verdict_rule.md)
to a comparison's compare.json: synthetic runs with known answers."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("verdict_mod",
                                               os.path.join(ROOT, "launch", "verdict.py"))
V = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(V)


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
  with pytest.raises(ValueError, match="no run of the reference arm 'grpo'"):
    V.verdict(_data([_run("fbos", 0, [0.2, 0.3])]), "grpo")


def test_cli_writes_json_md_png(tmp_path):
  runs = [_run(a, s, [0.2, 0.3 + 0.01 * s]) for a in ("grpo", "fbos") for s in range(2)]
  (tmp_path / "compare.json").write_text(json.dumps(_data(runs)))
  from absl.testing import flagsaver
  out = tmp_path / "out"
  with flagsaver.flagsaver(compare=str(tmp_path / "compare.json"), out=str(out)):
    V.FLAGS(["verdict"], known_only=True)
    V.main(["verdict"])
  assert json.loads((out / "verdict.json").read_text())["seeds"] == [0, 1]
  assert (out / "verdict.png").stat().st_size > 0 and "| `fbos` |" in (out / "verdict.md").read_text()
