"""launch/compare.py --quick: a smoke test that the comparison writes its files
(the numbers of a 1-layer model after 20 SFT steps mean nothing)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
