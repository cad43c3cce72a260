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
