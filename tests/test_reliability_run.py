"""Reliability round two, the run's side (issue 23): ids beyond the tokenizer, the
verifier's error counts in the metrics, a verifier that always fails, the skipped
step's number, summary.json after a resume."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fbos_jax import metrics as metrics_lib
from fbos_jax import sampling
from fbos_jax.model import qwen
from fbos_jax.rl import batch as batch_lib
from fbos_jax.rl import objectives
from fbos_jax.rl.context import DecodeError
from fbos_jax.rl.guards import VerifierFailingError
from fbos_jax.rl.trainer import RLTrainer

LIMIT = 20  # the "tokenizer's" size; the model has 32 rows


def _padded_rows_win():
  """An untied model whose rows beyond LIMIT have the largest logits everywhere:
  every token's embedding has a huge component k, the final norm keeps only k, so
  h = c * e_k with c > 0 and logit_j = c * W[k, j]; W[k, j >= LIMIT] = 10."""
  cfg = qwen.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=8, tie_embeddings=False)
  p = qwen.init_params(cfg, jax.random.key(0))
  k = 3
  p["embed"] = p["embed"].at[:, k].set(1000.0)
  p["final_norm"] = jnp.zeros_like(p["final_norm"]).at[k].set(1.0)
  w = jax.random.uniform(jax.random.key(1), (32,), minval=-1.0, maxval=1.0)
  p["unembed"] = p["unembed"].at[k].set(w.at[LIMIT:].set(10.0))
  return cfg, p


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ids_beyond_the_tokenizer_are_never_drawn(temperature):
  cfg, params = _padded_rows_win()
  prompts = [[1, 2, 3], [4, 5], [6]]
  kw = dict(key=jax.random.key(0), n_per_prompt=4, max_new_tokens=6, temperature=temperature,
            prompt_buckets=(4,))
  free = sampling.sample(params, cfg, prompts, **kw)
  assert (free.tokens >= LIMIT).all()  # the test's model really prefers the padded rows
  out = sampling.sample(params, cfg, prompts, vocab_limit=LIMIT, **kw)
  assert (out.tokens[out.response_mask > 0] < LIMIT).all()
  # the reported log-probs are of the restricted distribution, and the trainer's
  # chunked log-probs (vocab_limit in the loss config) are the same numbers
  t = temperature or 1.0
  ref = sampling.teacher_forced_logprobs(params, cfg, out.prompt_tokens, out.prompt_mask,
                                         out.tokens, out.response_mask, temperature=t,
                                         vocab_limit=LIMIT)
  np.testing.assert_allclose(out.logprobs, np.asarray(ref), atol=1e-4)
  b = batch_lib.make_policy_batch(
      [list(r[m > 0]) for r, m in zip(out.prompt_tokens, out.prompt_mask)], out.tokens,
      out.response_mask, np.zeros(len(out.tokens), np.float32), out.logprobs,
      np.zeros(len(out.tokens), bool), prompt_len=4, num_rows=len(out.tokens))
  lp, _ = objectives.sequence_logprobs(params, cfg, b, temperature=t, vocab_limit=LIMIT,
                                       compute_entropy=False)
  np.testing.assert_allclose(np.asarray(lp) * out.response_mask, out.logprobs, atol=1e-4)


def test_decoding_an_unknown_id_is_an_error(tmp_path, small, one_device_mesh):
  tr = RLTrainer(small("configs/grpo.py:tiny"), str(tmp_path), mesh=one_device_mesh)
  n = len(tr.ctx.tokenizer)
  assert tr.parts.sampling.round1.vocab_limit == n < tr.parts.model.vocab_size
  toks = np.asarray([[5, 6, n + 3, 7]], np.int32)
  with pytest.raises(DecodeError, match=rf"row 0 holds id\(s\) \[{n + 3}\]"):
    tr.ctx.decode(toks, np.asarray([4]))
  assert tr.ctx.decode(toks, np.asarray([2])) == [tr.ctx.tokenizer.decode([5, 6])]
  tr.close()


def test_error_kinds_reach_the_metrics_and_an_always_failing_verifier_stops(
    tmp_path, small, one_device_mesh):
  """verifier/<kind> (e.g. bad_reward) is logged per step; when every call of
  verifier.max_failed_steps steps in a row failed, the run stops with an error
  naming the field instead of training to the end on nothing."""
  c = small("configs/grpo.py:tiny", **{"train.steps": 5, "verifier.max_failed_steps": 2,
                                       "data.verifier": "fbos_jax.testing.verifiers:nan_verifier"})
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh)
  with pytest.raises(VerifierFailingError, match=r"2 steps in a row.*max_failed_steps=2"):
    tr.train()
  tr.close()
  rows = metrics_lib.read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
  assert [r["step"] for r in rows] == [1, 2]
  assert rows[0]["verifier/bad_reward"] == rows[0]["verifier/calls"] == 16


def test_skipped_step_warning_names_the_logged_step(tmp_path, small, one_device_mesh, caplog,
                                                     monkeypatch):
  monkeypatch.setattr(objectives, "term_weights",
                      lambda ucfg, step: jnp.full((len(ucfg.terms),), jnp.nan))
  tr = RLTrainer(small("configs/grpo.py:tiny", **{"train.steps": 1}), str(tmp_path),
                 mesh=one_device_mesh)
  with caplog.at_level("WARNING"):
    state, hist = tr.train()
  tr.close()
  assert hist[-1]["step"] == int(state.step) == 1
  assert "step 1: an optimizer step was skipped" in caplog.text, caplog.text


def test_summary_after_a_resume_keeps_the_start_eval_and_the_whole_rl_time(tmp_path, small):
  from fbos_jax.rl.run import run_training
  over = {"train.steps": 3, "train.eval_every": 0, "train.eval_k": 1, "train.eval_prompts": 8,
          "train.checkpoint_every": 1}
  with pytest.raises(KeyboardInterrupt):  # killed in step 2, after step 1's checkpoint
    def stop(step, *_):
      if step == 2:
        raise KeyboardInterrupt
    orig = RLTrainer.train
    RLTrainer.train = lambda self, *a, **k: orig(self, *a, on_step=stop, **k)
    try:
      run_training(small("configs/grpo.py:tiny", **over), str(tmp_path), plot=False)
    finally:
      RLTrainer.train = orig
  _, summary = run_training(small("configs/grpo.py:tiny", **over), str(tmp_path), plot=False)
  first = metrics_lib.read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))[0]
  assert first["step"] == 0
  assert summary["resumed"] and summary["eval_start"] == first["eval/accuracy"]
  saved = json.load(open(os.path.join(tmp_path, "summary.json")))
  assert saved["eval_start"] is not None
  assert saved["rl_seconds"] > 0
  drop = saved["held_out/drop_from_start"]  # the start and the end eval (eval_every=0)
  assert drop["greedy"] == pytest.approx(min(0.0, saved["eval_end"] - saved["eval_start"]))
  assert drop["sampled"] is None  # eval_k=1: no T=1 eval was made, none is invented
