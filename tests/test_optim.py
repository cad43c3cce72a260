"""The optimizer's schedule (fbos_jax/optim.py): no update trains at lr 0."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fbos_jax import optim
from fbos_jax.rl.config import OptimConfig


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
@pytest.mark.parametrize("warmup", [0, 1, 10])
def test_the_first_update_trains(schedule, warmup):
  """Update 0 moves the params: optax's warmup starts at 0, and used unshifted
  the first update of every warmed-up run (a whole RL step) was a no-op."""
  cfg = OptimConfig(learning_rate=1e-3, schedule=schedule, warmup_steps=warmup, total_steps=20)
  assert float(optim.schedule(cfg)(0)) > 0
  opt = optim.make_optimizer(cfg)
  params = {"w": jnp.ones((4,), jnp.float32)}
  state = optim.init_opt_state(opt, params, cfg)
  updates, _ = opt.update({"w": jnp.ones((4,))}, state, params)
  new = optax.apply_updates(params, updates)
  assert np.all(np.asarray(new["w"]) < 1.0)


def test_warmup_reaches_the_rate_at_its_last_update_and_decays_to_a_tenth():
  cfg = OptimConfig(learning_rate=1e-3, schedule="cosine", warmup_steps=10, total_steps=100)
  lr = [float(optim.schedule(cfg)(k)) for k in range(100)]
  np.testing.assert_allclose(lr[0], 1e-4, rtol=1e-6)  # 1/10 of the rate, not 0
  np.testing.assert_allclose(lr[9], 1e-3, rtol=1e-6)
  assert all(a < b for a, b in zip(lr[:9], lr[1:10]))
  np.testing.assert_allclose(lr[99], 1e-4, rtol=1e-5)  # the last update at 0.1 x lr
  const = OptimConfig(learning_rate=1e-3, warmup_steps=0, total_steps=5)
  assert [float(optim.schedule(const)(k)) for k in range(3)] == pytest.approx([1e-3] * 3)


def test_the_sft_warm_start_keeps_optax_count_and_rl_does_not():
  """The SFT recipe's schedule is unchanged (its first update at lr 0), so the warm
  start every result rests on is reproduced exactly; RL's first update trains."""
  import types
  import configs
  from fbos_jax import sharding as sh
  from fbos_jax.rl import config as config_lib
  from fbos_jax.rl import sft
  c = configs.load("grpo:tiny_chain")
  name, stage = sft.stage_configs(c)[0]
  ctx = types.SimpleNamespace(parts=types.SimpleNamespace(update=types.SimpleNamespace(
      loss=types.SimpleNamespace(vocab_limit=0))), mesh=sh.make_mesh(c.mesh), rules=None)
  ocfg = sft._sft_setup(stage, ctx, int(stage.sft.steps))[0]
  assert ocfg.warmup_from_zero and float(optim.schedule(ocfg)(0)) == 0.0
  assert ocfg.learning_rate == 3e-3 and ocfg.warmup_steps == 20  # the demos stage
  rl = config_lib.optim_config(c.optim, 100)
  assert not rl.warmup_from_zero and float(optim.schedule(rl)(0)) == pytest.approx(1e-5 / 5)
