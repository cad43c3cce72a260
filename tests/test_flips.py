"""fbos_jax.testing.flips: a row may differ between two samplers only where its first
differing token is a proven near-tie. Ties are built with a logit bias on a tiny
model (two tokens of equal probability for greedy; a CDF boundary on the row's
own uniform for sampling); a non-tie, and a row drawn on a wrong stream id, fail."""

import dataclasses

import jax
import numpy as np
import pytest

from fbos_jax import sampling
from fbos_jax.model import qwen
from fbos_jax.testing import flips as F

R = 4
BASE = dict(max_new_tokens=R, prompt_buckets=(8,), batch_buckets=(4,))
PROMPTS = [[3, 9, 4, 17], [5, 2], [8, 8, 1]]


@pytest.fixture(scope="module")
def tiny():
  cfg = qwen.ModelConfig(model_type="qwen3", vocab_size=61, hidden_size=32, intermediate_size=48,
                         num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                         rope_theta=10000.0)
  params = qwen.init_params(cfg, jax.random.PRNGKey(0))
  return params, cfg


def first_logits(params, cfg, out):
  """The logits of every row's step 0 (the prompt alone): [N, V]."""
  rmask = np.zeros(out.tokens.shape, np.int32)
  return np.asarray(sampling.teacher_forced_logits(params, cfg, out.prompt_tokens,
                                                   out.prompt_mask, out.tokens, rmask))[:, 0]


def tie_bias(logits, x, y, px):
  """Per-prompt bias [P, V] that leaves tokens x and y with probabilities px and
  1 - px at step 0 (temperature 1) and every other token ~0."""
  bias = np.full(logits.shape, -1e4, np.float32)
  bias[:, x] = -logits[:, x] + np.log(px)
  bias[:, y] = -logits[:, y] + np.log(1.0 - px)
  return bias


def with_token(out, row, step, token):
  """``out`` with one token changed (a row that took another token at ``step``)."""
  tokens = out.tokens.copy()
  tokens[row, step] = token
  return dataclasses.replace(out, tokens=tokens)


def test_greedy_tie_is_proven_and_a_non_tie_fails(tiny):
  params, cfg = tiny
  kw = dict(BASE, temperature=0.0)
  plain = sampling.sample(params, cfg, PROMPTS, key=jax.random.PRNGKey(1), **kw)
  x, y, z = 7, 30, 44
  bias = tie_bias(first_logits(params, cfg, plain), x, y, 0.5)
  out = sampling.sample(params, cfg, PROMPTS, key=jax.random.PRNGKey(1), logit_bias=bias, **kw)
  assert set(out.tokens[:, 0].tolist()) <= {x, y}
  other = y if out.tokens[1, 0] == x else x
  flips = F.assert_same_rows(out, with_token(out, 1, 0, other), params, cfg, logit_bias=bias, **kw)
  assert [(f.row, f.step) for f in flips] == [(1, 0)] and flips[0].gap <= 1e-6
  assert F.assert_same_rows(out, out, params, cfg, logit_bias=bias, **kw) == []
  with pytest.raises(AssertionError, match="not near-ties"):
    F.assert_same_rows(out, with_token(out, 1, 0, z), params, cfg, logit_bias=bias, **kw)
  with pytest.raises(AssertionError, match="not near-ties"):  # another token, no tie
    F.assert_same_rows(plain, with_token(plain, 2, 1, (plain.tokens[2, 1] + 1) % 61), params,
                       cfg, **kw)


def test_sampled_draw_on_a_cdf_boundary_is_proven_and_off_it_fails(tiny):
  """Row 2's step-0 uniform put exactly on the boundary between tokens x < y: the
  other token is a proven flip; with the boundary 0.01 away it is not."""
  params, cfg = tiny
  key = jax.random.PRNGKey(2)
  kw = dict(BASE, temperature=1.0)
  plain = sampling.sample(params, cfg, PROMPTS, key=key, **kw)
  logits = first_logits(params, cfg, plain)
  u = float(sampling.key_uniform(key, 0, 2))  # row 2 = prompt 2, sample 0: stream 2
  x, y = 12, 40
  for px, proven in ((u, True), (min(u + 0.01, 0.999), False)):
    bias = tie_bias(logits, x, y, px)
    out = sampling.sample(params, cfg, PROMPTS, key=key, logit_bias=bias, **kw)
    other = y if out.tokens[2, 0] == x else x
    flipped = with_token(out, 2, 0, other)
    if proven:
      flips = F.assert_same_rows(out, flipped, params, cfg, key=key, logit_bias=bias, **kw)
      assert [(f.row, f.step, f.tokens) for f in flips] == [(2, 0, (int(out.tokens[2, 0]), other))]
      assert flips[0].gap <= 1e-5
    else:
      with pytest.raises(AssertionError, match="not near-ties"):
        F.assert_same_rows(out, flipped, params, cfg, key=key, logit_bias=bias, **kw)


def test_a_row_on_a_wrong_stream_fails(tiny):
  """What 'accept one differing row' let through: prompt 2's rows drawn on another
  stream id (a wrong sid on a staged row) differ without a near-tie."""
  params, cfg = tiny
  key = jax.random.PRNGKey(3)
  kw = dict(BASE, temperature=1.0)
  good = sampling.sample(params, cfg, PROMPTS, key=key, n_per_prompt=2, **kw)
  bad = sampling.sample(params, cfg, PROMPTS, key=key, n_per_prompt=2, stream_ids=[0, 1, 7], **kw)
  np.testing.assert_array_equal(good.tokens[:4], bad.tokens[:4])
  assert (good.tokens[4:] != bad.tokens[4:]).any()
  with pytest.raises(AssertionError, match="not near-ties"):
    F.assert_same_rows(good, bad, params, cfg, key=key, n_per_prompt=2, **kw)
  # the stream ids the samplers used make the same rows the same
  again = sampling.sample(params, cfg, PROMPTS, key=key, n_per_prompt=2, stream_ids=[0, 1, 7],
                          **kw)
  assert F.assert_same_rows(bad, again, params, cfg, key=key, n_per_prompt=2,
                            stream_ids=[0, 1, 7], **kw) == []


def test_key_uniform_is_the_samplers_draw(tiny):
  """sampling.key_uniform is the uniform the static sampler's row draws from: with
  every token but two at probability 0, the token follows u against p(x)."""
  params, cfg = tiny
  key = jax.random.PRNGKey(4)
  kw = dict(BASE, temperature=1.0)
  plain = sampling.sample(params, cfg, PROMPTS, key=key, **kw)
  u = np.asarray([float(sampling.key_uniform(key, 0, r)) for r in range(3)])
  px = 0.5
  out = sampling.sample(params, cfg, PROMPTS, key=key,
                        logit_bias=tie_bias(first_logits(params, cfg, plain), 5, 50, px), **kw)
  want = np.where(u < px - 1e-4, 5, np.where(u > px + 1e-4, 50, -1))
  sure = want >= 0
  np.testing.assert_array_equal(out.tokens[sure, 0], want[sure])
