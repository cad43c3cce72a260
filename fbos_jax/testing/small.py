"""Small configs and meshes for tests, shared by the suite and its subprocess workers.

``small_config("configs/fbos.py:tiny")`` is the tiny variant shrunk so that a
step takes seconds on 2 CPU cores: 4 prompts, groups of 4 (GFPO: 6), 6 new
tokens, a one-layer model, 1-2 digit sums. Tests that build the same shrunk
config share every compiled program (the update and state builders are cached
per config, ``fbos_jax/rl/update.py``; the samplers per shape bucket).
"""

from __future__ import annotations

import jax

import configs
from fbos_jax.engine import types as engine_types


def small_config(spec: str, **overrides):
  """A tiny config shrunk further, with dotted-field ``overrides``."""
  c = configs.load(spec)
  c.rl.prompts_per_step = 4
  c.rl.group_size = 4 if not c.rl.gfpo_k and not c.rl.gfpo_adaptive else 6
  if c.rl.gfpo_k:
    c.rl.gfpo_k = 3
  c.rl.round2_size = 4
  c.rl.epa_max_per_prompt = 4
  c.sampling.max_new_tokens = 6
  c.train.steps = 2
  c.train.eval_every = 0
  c.train.eval_prompts = 8
  c.train.checkpoint_every = 2
  c.train.warm_start = ""
  c.train.progress = False
  c.model.num_layers = 1
  c.model.hidden_size = 64
  c.model.intermediate_size = 128
  c.model.num_heads = 2
  c.model.num_kv_heads = 1
  # 1-2 digit sums: answers fit the 6 new tokens above and feedback names digits
  # (the tiny default task, sorting 4-10 digits, runs in test_default_task_runs)
  c.data.task = "arithmetic"
  c.data.difficulty, c.data.max_difficulty = 1, 2
  # the engine at its library defaults, powers of four (tiny's slots and buckets
  # are sized for its 128-row rounds and 656-token FAPs)
  for k, v in engine_types.engine_config_defaults().items():
    c.engine[k] = v
  c.engine.bucket_growth = 4
  for dotted, value in overrides.items():
    configs.set_field(c, dotted, value)
  return c


def free_port() -> int:
  """A TCP port nobody listens on now (a coordinator for a multi-process test)."""
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def one_device_mesh():
  """A mesh over the first device only (the default axes, all of size 1)."""
  from fbos_jax import sharding as sh
  return sh.make_mesh({"data": 1}, devices=jax.devices()[:1])


def length_reward(example, response):
  """A verifier with a spread of rewards for an untrained model (so groups have
  non-zero advantages and the params move), a pure function of the response:
  ``--config.data.verifier=fbos_jax.testing.small:length_reward``."""
  del example
  return (len(response) % 3) / 2.0, f"length {len(response)}"


def parity_reward(example, response):
  """A verifier a random model passes about half the time (even-length answers),
  so round 2 has correct rows for EPA to pull back:
  ``--config.data.verifier=fbos_jax.testing.small:parity_reward``."""
  del example
  ok = len(response) % 2 == 0
  return float(ok), "correct" if ok else f"the answer has odd length {len(response)}"


def assert_resume_matches_straight(make_trainer, workdir: str,
                                   drop_prefixes=("time/", "tokens/per_s", "async/")):
  """4 steps straight against 2 steps, a fresh trainer, 2 more (``make_trainer(dir)``
  builds a trainer of a 4-step config writing to ``dir``): the same state, leaf for
  leaf, and the same metrics rows but the keys starting with ``drop_prefixes``
  (timings and busy fractions). Returns (straight state, resumed state)."""
  import os
  import numpy as np
  from fbos_jax import metrics as metrics_lib
  tr = make_trainer(os.path.join(workdir, "straight"))
  s_straight, _ = tr.train()
  tr.close()
  tr = make_trainer(os.path.join(workdir, "resumed"))
  tr.train(tr.init_state(), steps=2)
  tr.close()
  tr = make_trainer(os.path.join(workdir, "resumed"))
  s_resumed, _ = tr.train()
  tr.close()
  for x, y in zip(jax.tree.leaves(jax.device_get(s_straight)),
                  jax.tree.leaves(jax.device_get(s_resumed))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  drop = lambda r: {k: v for k, v in r.items() if not k.startswith(tuple(drop_prefixes))}
  ra, rb = (metrics_lib.read_jsonl(os.path.join(workdir, d, "metrics.jsonl"))
            for d in ("straight", "resumed"))
  assert [drop(r) for r in ra] == [drop(r) for r in rb]
  return s_straight, s_resumed
