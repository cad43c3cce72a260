"""The path a real user runs (issue 15), at test size: a Qwen3 checkpoint directory
with the real 151,936-token BPE vocabulary and chat template, the arithmetic word
problems (JSONL) with math-verify, verbose FAPs, bf16 params, an SFT warm start on
the gold solutions, FBOS steps, a checkpoint, export and a transformers reload.

The CPU-size run of the same path (`configs/fbos.py:qwen3_smoke`, README "Train a
real Qwen checkpoint") uses the same code with larger numbers.
"""

import json
import os

import jax
import numpy as np
import pytest

from configs import load
from fbos_jax import metrics as metrics_lib
from fbos_jax.testing import qwen_fixture


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
  """A random real-shape Qwen3 (real vocabulary and head sizes, hidden 64, 2 layers, bf16)."""
  out = tmp_path_factory.mktemp("qwen3_small")
  return qwen_fixture.build_qwen3_checkpoint(str(out / "ckpt"), hidden_size=64,
                                             intermediate_size=128, num_layers=2)


def smoke_config():
  c = load("configs/fbos.py:qwen3_smoke")
  # 4 x 2 rollouts split over the 8 (fake) devices of the test session
  c.rl.prompts_per_step, c.rl.group_size, c.rl.round2_size = 4, 2, 2
  c.rl.epa_max_per_prompt = 2
  c.sampling.max_new_tokens = 8
  c.sampling.batch_buckets = (8,)
  c.sft.steps, c.sft.batch_size = 1, 4
  c.train.steps, c.train.eval_every, c.train.eval_prompts = 2, 2, 2
  c.train.checkpoint_every = 2
  c.train.progress = False
  return c


def test_fap_of_a_failed_math_answer(checkpoint_dir, tmp_path):
  """The FAP of a wrong answer holds the verifier's feedback, not the gold answer
  (unless data.feedback_reveals_answer), and fits the FAP bucket, in real tokens."""
  from fbos_jax import data
  from fbos_jax.rl.config import with_checkpoint_model
  from fbos_jax.rl.context import RolloutContext
  for reveal in (False, True):
    c = with_checkpoint_model(smoke_config(), checkpoint_dir)
    c.data.feedback_reveals_answer = reveal
    env = RolloutContext.build(c, str(tmp_path))
    ex = next(e for e in data.held_out_examples(c.data, c.train.eval_prompts)
              if e["answer"] not in e["prompt"])
    wrong = str(int(ex["answer"]) + 7)
    response = f"So the total is {wrong}. The answer is $\\boxed{{{wrong}}}$."
    rewards, feedback, errors, _ = env.verify([ex], [response])
    assert rewards[0] < 1 and not errors[0] and feedback[0]
    ids = env.prompts.fap(ex["prompt"], response, feedback[0]).token_ids
    text = env.tokenizer.decode(ids)
    assert feedback[0] in text and ex["prompt"] in text and response in text
    assert "<|im_start|>user" in text  # the checkpoint's chat template
    assert (ex["answer"] in text.replace(ex["prompt"], "")) == reveal, text
    assert len(ids) <= max(c.sampling.fap_prompt_buckets)
    env.close()


@pytest.mark.slow  # default suite under 15 min (issue 35): .ci/run runs the slow set too
def test_qwen_checkpoint_trains_exports_and_reloads(checkpoint_dir, tmp_path):
  """--init_from_hf on the real-shape checkpoint: SFT on gold solutions, 2 FBOS
  steps (bf16 compute, float32 master) with math-verify rewards, a checkpoint; then export, transformers
  reloads the export, and its greedy output equals our sampler's token for token."""
  from fbos_jax.rl import export as export_lib
  from fbos_jax.rl.run import run_training
  wd = str(tmp_path / "run")
  state, summary = run_training(smoke_config(), wd, init_from_hf=checkpoint_dir, plot=False)
  assert int(state.step) == 2 and summary["rl_steps"] == 2
  assert all(x.dtype == jax.numpy.float32 for x in jax.tree.leaves(state.params))
  rows = metrics_lib.read_jsonl(os.path.join(wd, "metrics.jsonl"))
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert {"reward/round1", "reward/round2", "feedback/fix_rate"} <= set(rows[-1])
  # FAP lengths in the checkpoint's own BPE tokens: the chat template and the
  # math verifier's feedback make a FAP far longer than the bare problem
  faps = [r["fap/length_tokens"] for r in rows if "fap/length_tokens" in r]
  assert faps and all(40 < x <= max(smoke_config().sampling.fap_prompt_buckets) for x in faps)
  out = str(tmp_path / "export")
  paths, step = export_lib.export_run(smoke_config(), wd, out, init_from_hf=checkpoint_dir)
  assert step == 2
  assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= \
      set(os.listdir(out))
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["max_position_embeddings"] == 40_960
  same = export_lib.check_greedy(smoke_config(), wd, out, 2, init_from_hf=checkpoint_dir)
  assert [r.status for r in same] == ["equal", "equal"]


def test_eval_of_a_checkpoint_stops_where_training_stops(checkpoint_dir, tmp_path, monkeypatch):
  """launch/eval.py used to apply the checkpoint's architecture without its
  generation stop ids, so a Qwen run's eval stopped only at the tokenizer's EOS:
  the context eval samples with now holds the same stop ids as training's."""
  from fbos_jax.model import hf
  from fbos_jax.rl import context, evaluation
  from fbos_jax.rl.config import with_checkpoint_model

  class Built(Exception):
    pass

  seen = []
  real = context.RolloutContext.build.__func__

  def build(cls, config, *args, **kwargs):
    seen.append(real(cls, config, *args, **kwargs).stop_ids)
    raise Built

  monkeypatch.setattr(context.RolloutContext, "build", classmethod(build))
  with pytest.raises(Built):
    evaluation.evaluate_checkpoint(smoke_config(), str(tmp_path), init_from_hf=checkpoint_dir)
  with pytest.raises(Built):  # what training builds
    context.RolloutContext.build(with_checkpoint_model(smoke_config(), checkpoint_dir),
                                 str(tmp_path))
  want = hf.generation_stop_ids(checkpoint_dir)
  assert len(want) >= 2 and set(want) <= set(seen[0])
  assert seen[0] == seen[1]


def test_dry_run_plans_the_checkpoints_architecture(checkpoint_dir):
  """``--dry_run --init_from_hf=DIR`` plans the checkpoint's real model (here 2
  layers, hidden 64, the real 151,936-token vocabulary), not the config's."""
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run(
      [sys.executable, "launch/train.py", "--config=configs/fbos.py:qwen3_smoke", "--dry_run",
       "--mesh_devices=1", f"--init_from_hf={checkpoint_dir}"], cwd=root, capture_output=True,
      text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-2000:]
  from fbos_jax.model import qwen
  from fbos_jax.rl.config import with_checkpoint_model
  want = qwen.count_params(qwen.abstract_params(qwen.ModelConfig.from_dict(
      with_checkpoint_model(smoke_config(), checkpoint_dir).model)))
  assert want != qwen.count_params(qwen.abstract_params(qwen.ModelConfig.from_dict(
      smoke_config().model)))  # the config alone plans another model
  assert f"params: {want:,}" in out.stdout, out.stdout[-2000:]
