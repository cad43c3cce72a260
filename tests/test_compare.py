"""A comparison (fbos_jax/experiments/compare.py): its tables, the sweep's pick, a
--resume's check; and launch/compare.py --quick, a smoke test that the comparison
writes its files (the numbers of a 1-layer model after 20 SFT steps mean nothing)."""

import json
import os
import subprocess
import sys

import pytest

from fbos_jax.experiments import compare as cmp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # ~2-3 min on 2 cores: opt in with -m slow
def test_compare_quick_writes_png_json_and_table(tmp_path):
  out = subprocess.run(
      [sys.executable, "launch/compare.py", "--quick", f"--workdir={tmp_path}",
       "--algos=grpo,golf,gfpo,fbos"],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=""))
  assert out.returncode == 0, out.stderr[-3000:]
  for name in ("compare.png", "compare.json", "compare.md"):
    assert (tmp_path / name).stat().st_size > 0, name
  data = json.loads((tmp_path / "compare.json").read_text())
  assert set(data["table"]) == {"grpo", "golf", "gfpo", "fbos"}
  # equal rollout budgets: every run stops at the first step that reaches it
  for run in data["runs"]:
    assert run["rows"][-1]["rollouts"] >= data["budget_rollouts"]
    assert run["rows"][-2]["rollouts"] < data["budget_rollouts"]
  md = (tmp_path / "compare.md").read_text()
  assert "| fbos |" in md and "ELR" in md


def _rows(steps, per_step, acc0, gain, **per):
  rows = [{"step": 0, "rollouts": 0, "eval/accuracy": acc0, "eval/length": 8.0}]
  for s in range(1, steps + 1):
    r = {"step": s, "rollouts": s * per_step, "response/length": 8.0,
         "policy/entropy": 0.5, "policy/entropy_onpolicy": 0.6, "policy/grad_norm": 2.0,
         "grad_norm/epa": 1.5, "grad_norm/ecc": 1.0,
         "feedback/fix_rate": 0.2, "feedback/fix_rows": 10, "groups/all_fail_frac": 0.1}
    for k, (rate, count) in per.items():
      r[f"feedback/fix_rate_r1succ_{k}"] = rate(s)
      r[f"feedback/fix_rows_r1succ_{k}"] = count(s)
    if s == steps:
      r["eval/accuracy"] = acc0 + gain
    rows.append(r)
  return rows


def test_partial_outputs_say_so(tmp_path):
  """While a comparison runs, its files are rewritten after every run and say
  how many runs they hold; --resummarize keeps the label."""
  results = [{"label": "grpo", "seed": 0, "rows": _rows(2, 128, 0.5, 0.1), "stop": "rollouts"}]
  sft = {"eval/accuracy": 0.5, "eval/length": 8.0}
  cmp.write_outputs(str(tmp_path), results, sft, 256, 1, 60.0, meta={"partial": "1 of 9 runs"},
                    quiet=True)
  assert "PARTIAL: 1 of 9 runs" in (tmp_path / "compare.md").read_text()
  assert json.loads((tmp_path / "compare.json").read_text())["partial"] == "1 of 9 runs"
  cmp.resummarize(str(tmp_path))
  assert "PARTIAL: 1 of 9 runs" in (tmp_path / "compare.md").read_text()
  cmp.write_outputs(str(tmp_path), results, sft, 256, 1, 60.0, meta={}, quiet=True)
  assert "PARTIAL" not in (tmp_path / "compare.md").read_text()


def _options(**over):
  return cmp.Options(**{"workdir": "/unused", "variant": "tiny_chain", "arms": ("grpo", "fbos"),
                        "lrs": (1e-5, 3e-5), **over})


def _identity(**over):
  return cmp.identity(_options(**over), 256, 5)


def test_resume_keeps_finished_runs_and_refuses_another_comparison(tmp_path):
  """--resume keeps the finished runs (and sweep runs) of this comparison, only the
  requested ones, and refuses a compare.json whose identity differs in anything
  that changes a run (variant, budget, --set, --task, the sweep, an arm's
  definition), naming the field, instead of mixing the two (issue 34: another
  comparison's runs were kept and reported, exit 0)."""
  ident = _identity()
  arms = ident["arms"]
  results = [{"label": l, "seed": s, "rows": _rows(2, 128, 0.5, 0.1), "stop": "rollouts"}
             for l, s in (("grpo", 0), ("fbos", 0), ("grpo", 1))]
  sweep = [{"label": "grpo", "seed": 0, "learning_rate": 1e-5, "rows": _rows(2, 128, 0.5, 0.1)}]
  sft = {"eval/accuracy": 0.5, "eval/length": 8.0}
  cmp.write_outputs(str(tmp_path), results, sft, 256, 2, 60.0, quiet=True,
                    meta={"variant": "tiny_chain", "arms": arms, "partial": "3 of 4 runs",
                          "identity": ident, "sweep_runs": sweep})
  meta = {"identity": ident}
  kept, kept_sweep = cmp.resumed_runs(str(tmp_path), meta, ["grpo", "fbos"], [0, 1])
  assert [(r["label"], r["seed"]) for r in kept] == [("grpo", 0), ("fbos", 0), ("grpo", 1)]
  assert kept_sweep == sweep and meta["resumed"]["wall_seconds_before"] == 60.0
  kept, _ = cmp.resumed_runs(str(tmp_path), dict(meta), ["fbos"], [0])
  assert [(r["label"], r["seed"]) for r in kept] == [("fbos", 0)]
  for over, field in (({"variant": "tiny"}, "variant"),
                      ({"set": ("optim.weight_decay=0.1",)}, "set"),
                      ({"task": "sort"}, "task"), ({"lrs": (1e-5,)}, "lrs"),
                      ({"shared_warm_start": True}, "shared_warm_start")):
    with pytest.raises(cmp.FlagError, match=f"was run with {field}="):
      cmp.resumed_runs(str(tmp_path), {"identity": _identity(**over)}, ["grpo"], [0])
  with pytest.raises(cmp.FlagError, match="budget_rollouts=256.*budget_rollouts=512"):
    cmp.resumed_runs(str(tmp_path), {"identity": dict(ident, budget_rollouts=512)}, ["grpo"], [0])
  other = dict(arms, fbos=dict(arms["fbos"], flavors="fap_all"))
  with pytest.raises(cmp.FlagError, match="arm 'fbos'"):
    cmp.resumed_runs(str(tmp_path), {"identity": dict(ident, arms=other)}, ["fbos"], [0])
  with pytest.raises(cmp.FlagError, match="does not exist"):
    cmp.resumed_runs(str(tmp_path / "nowhere"), dict(meta), ["grpo"], [0])
  # a kept run the verdict would refuse (an accuracy out of [0, 1]) is named, not kept
  path = tmp_path / "compare.json"
  data = json.loads(path.read_text())
  data["runs"][1]["rows"][-1]["eval/accuracy"] = 1.5
  path.write_text(json.dumps(data))
  with pytest.raises(cmp.FlagError, match=r"cannot be kept: .*arm 'fbos', seed 0.*1\.5"):
    cmp.resumed_runs(str(tmp_path), dict(meta), ["fbos"], [0])
  assert [r["label"] for r in cmp.resumed_runs(str(tmp_path), dict(meta), ["grpo"], [0])[0]] \
      == ["grpo"]                                  # the broken run not asked for: no matter
  path.write_text(path.read_text()[:200])         # a truncated file: named, line and column
  with pytest.raises(cmp.FlagError, match=r"compare.json: not valid JSON at line"):
    cmp.resumed_runs(str(tmp_path), dict(meta), ["grpo"], [0])


def test_a_resume_of_another_comparison_is_refused_before_any_training(tmp_path):
  """The check runs before the warm starts (it used to come after them: minutes of
  SFT, then the refusal)."""
  opts = cmp.Options(workdir=str(tmp_path), variant="tiny_chain", arms=("grpo",), resume=True,
                     budget=256, eval_every=5)
  (tmp_path / "compare.json").write_text(json.dumps(
      {"runs": [], "wall_seconds": 1.0, "identity": dict(cmp.identity(opts, 256, 5),
                                                         variant="tiny")}))
  called = []
  orig = cmp.warm_starts
  cmp.warm_starts = lambda opts, seeds: called.append(seeds)
  try:
    with pytest.raises(cmp.FlagError, match="was run with variant='tiny'"):
      cmp.run(opts, command="python launch/compare.py --resume ...")
  finally:
    cmp.warm_starts = orig
  assert not called


def test_the_sweep_table_picks_per_arm_and_reports_an_arm_with_no_stable_rate():
  runs = []
  for label, lr, accs in (("grpo", 1e-5, [0.40, 0.39, 0.45]), ("grpo", 3e-5, [0.40, 0.38, 0.50]),
                          ("fbos", 1e-5, [0.40, 0.30, 0.45]), ("fbos", 3e-5, [0.40, 0.20, 0.5])):
    rows = [{"step": i, "rollouts": 640 * i, "eval/accuracy": a, "eval/pass@1_sampled": a / 2}
            for i, a in enumerate(accs)]
    runs.append({"label": label, "seed": 0, "learning_rate": lr, "rows": rows})
  table, picks = cmp.sweep_table(runs, ["grpo", "fbos"], [1e-5, 3e-5])
  assert picks == {"grpo": 3e-5, "fbos": None}
  assert table["fbos"]["1e-05"]["drop_greedy"] == pytest.approx(-0.10)
  assert not table["fbos"]["1e-05"]["stable"] and table["grpo"]["3e-05"]["stable"]
  _, picks = cmp.sweep_table(runs[:1], ["grpo"], [1e-5, 3e-5])
  assert picks == {}  # an unfinished sweep picks nothing


def test_summary_pools_fix_rates_and_labels_equal_step_arms():
  """The summary's fix rate per bucket is pooled over rows (a step with 1 row does
  not weigh like a step with 9), and equal-steps arms are labelled in every table."""
  per = {"0": (lambda s: 1.0 if s == 1 else 0.0, lambda s: 1 if s == 1 else 9)}
  results = [{"label": "grpo", "seed": 0, "rows": _rows(2, 128, 0.5, 0.1), "stop": "rollouts"},
             {"label": "fbos", "seed": 0, "rows": _rows(2, 128, 0.5, 0.2, **per),
              "stop": "rollouts"},
             {"label": "fbos_16p_equal_steps", "seed": 0,
              "rows": _rows(2, 256, 0.5, 0.3, **per), "stop": "steps"}]
  table = cmp.summarize(results, 8.0, 256)
  assert table["fbos"]["fix_rate_r1succ_0"]["mean"] == 0.1  # (1*1 + 0*9) / 10, not 0.5
  assert table["fbos"]["entropy_onpolicy"]["mean"] == 0.6
  assert table["fbos"]["grad_norm_ecc"]["mean"] == 1.0
  assert table["fbos_16p_equal_steps"]["rollouts_used"]["mean"] == 512
  md, diag = cmp.markdown(table), cmp.diagnostics_markdown(table)
  assert "| fbos_16p_equal_steps (EQUAL STEPS) |" in md and "equal steps" in diag
  assert "| fbos |" in md and "fix rate, r1 succ 0" in diag


@pytest.mark.slow
def test_compare_quick_ablation_arms(tmp_path):
  """--quick over three pre-registered arms: the equal-steps arm stops at the
  reference's step count (and is labelled so), the outputs carry the command and
  the note, and the warm start is probed."""
  out = subprocess.run(
      [sys.executable, "launch/compare.py", "--quick", f"--workdir={tmp_path}",
       "--arms=grpo,fbos_alternate,fbos_16p_equal_steps", "--probe_batches=1",
       "--note=pytest smoke run"],
      cwd=ROOT, capture_output=True, text=True, timeout=900,
      env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=""))
  assert out.returncode == 0, out.stderr[-3000:]
  data = json.loads((tmp_path / "compare.json").read_text())
  assert list(data["table"]) == ["grpo", "fbos_alternate", "fbos_16p_equal_steps"]
  assert data["note"] == "pytest smoke run" and "--arms=" in data["command"]
  runs = {r["label"]: r for r in data["runs"]}
  assert runs["fbos_16p_equal_steps"]["rows"][-1]["step"] == data["equal_steps"] \
      == runs["grpo"]["rows"][-1]["step"]
  assert runs["fbos_16p_equal_steps"]["rows"][-1]["rollouts"] > data["budget_rollouts"]
  for key in ("policy/entropy_onpolicy", "grad_norm/epa", "grad_norm/ecc",
              "feedback/fix_rate_r1succ_0", "fap/truncated_frac"):
    assert key in runs["fbos_alternate"]["rows"][-1], key
  assert data["probes"]["0"]["batches"] == 1
  md = (tmp_path / "compare.md").read_text()
  assert "pytest smoke run" in md and "(EQUAL STEPS)" in md and "grad norm ECC" in md
  assert (tmp_path / "compare.png").stat().st_size > 0


def test_the_launcher_only_parses_flags(tmp_path):
  """launch/compare.py --resummarize rebuilds compare.md from compare.json alone,
  and an unknown arm is a usage error that names it (before any training)."""
  results = [{"label": "grpo", "seed": 0, "rows": _rows(2, 128, 0.5, 0.1), "stop": "rollouts"}]
  cmp.write_outputs(str(tmp_path), results, {"eval/accuracy": 0.5, "eval/length": 8.0}, 256, 1,
                    60.0, meta={"command": "python launch/compare.py --arms=grpo"}, quiet=True)
  md = (tmp_path / "compare.md").read_text()
  (tmp_path / "compare.md").unlink()
  run = lambda *a: subprocess.run([sys.executable, "launch/compare.py", *a], cwd=ROOT,
                                  capture_output=True, text=True, timeout=300,
                                  env=dict(os.environ, JAX_PLATFORMS="cpu"))
  out = run("--resummarize", f"--workdir={tmp_path}")
  assert out.returncode == 0, out.stderr[-3000:]
  assert (tmp_path / "compare.md").read_text() == md
  out = run("--arms=grpo,nope", f"--workdir={tmp_path / 'bad'}")
  assert out.returncode == 1 and "unknown arm(s) ['nope']" in out.stderr
