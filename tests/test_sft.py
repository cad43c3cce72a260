"""SFT warm start: verified demonstrations, FAP corrections in their own slot, caching."""

import os
import random

import jax
import numpy as np
import pytest

from test_trainer import one_device_mesh, small

from fbos_jax.rl import sft
from fbos_jax.rl.trainer import RLTrainer


def _setup(tmp_path, **over):
  c = small("configs/fbos.py:tiny", **{"sft.batch_size": 16, "sft.fap_fraction": 0.25,
                                       "sft.steps": 30, "sft.warmup_steps": 3, **over})
  tr = RLTrainer(c, str(tmp_path), mesh=one_device_mesh())
  return c, tr


def test_demonstrations_are_verified_and_corrections_are_faps(tmp_path):
  c, tr = _setup(tmp_path)
  env = tr.env
  examples = env.next_train_batch() + env.next_train_batch()
  (pp, pr), (cp, cr) = sft.demonstration_rows(env, examples, conditional=False,
                                              rng=random.Random(0), num_corrections=3)
  assert len(cp) == 3 and len(pp) == len(examples) - 3
  thr = c.verifier.success_threshold
  for ex, ctx, resp in zip(examples[:3], cp, cr):
    text = env.tokenizer.decode(resp[:-1])
    assert resp[-1] == env.eos_id and env.verifier(ex, text).reward >= thr
    assert ctx[:len(env.prompt_ids(ex))] != env.prompt_ids(ex) or len(ctx) > len(env.prompt_ids(ex))
    assert "wrong" in env.tokenizer.decode(ctx) or "digit" in env.tokenizer.decode(ctx)
  for ex, ctx, resp in zip(examples[3:], pp, pr):
    assert ctx == env.prompt_ids(ex)
    assert env.verifier(ex, env.tokenizer.decode(resp[:-1])).reward >= thr
  tr.close()


def test_sft_lowers_both_nlls_and_is_cached(tmp_path):
  c, tr = _setup(tmp_path)
  params = tr.init_state().params
  copy = jax.tree.map(lambda a: a.copy(), params)  # train_sft donates its params
  trained, hist = sft.train_sft(c, tr.env, copy, mesh=tr.mesh, progress=False)
  assert hist[-1]["nll_plain"] < 0.7 * hist[0]["nll_plain"], hist
  assert hist[-1]["nll_corrections"] < 0.7 * hist[0]["nll_corrections"], hist
  # warm_start trains once, then reuses the cache
  p1, cached1 = sft.warm_start(c, tr.env, jax.tree.map(lambda a: a.copy(), params),
                               mesh=tr.mesh, cache_dir=str(tmp_path / "sft"))
  p2, cached2 = sft.warm_start(c, tr.env, params, mesh=tr.mesh, cache_dir=str(tmp_path / "sft"))
  assert (cached1, cached2) == (False, True)
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # a cache trained under other SFT settings is not silently reused
  c.sft.steps += 1
  with pytest.raises(ValueError, match=r"(?s)different config.*sft\.steps: cached"):
    sft.warm_start(c, tr.env, params, mesh=tr.mesh, cache_dir=str(tmp_path / "sft"))
  assert os.path.exists(tmp_path / "sft" / "params")  # nothing deleted
  tr.close()
