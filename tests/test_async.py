"""AReaL's system (issue 25): the asynchronous loop, its config and bad input, the
device split, versions per token under in-flight weight updates, the weight sync,
and resume after kill -9."""

import os

import jax
import numpy as np
import pytest

import configs
from fbos_jax import metrics as metrics_lib
from fbos_jax.rl import async_rl
from fbos_jax.rl import config as config_lib
from fbos_jax.rl.async_trainer import AsyncRLTrainer
from fbos_jax.rl.trainer import RLTrainer

DROP = ("time/", "tokens/per_s", "async/", "staleness/")


def _drop(row):
  return {k: v for k, v in row.items() if not k.startswith(DROP)}


def test_eta0_colocated_equals_the_synchronous_loop(tmp_path, small, one_device_mesh):
  """rl.max_staleness=0, colocated: the worker thread, the buffer and the admission
  rule give the synchronous trainer's params and metrics bit for bit."""
  spec = "configs/fbos.py:tiny"
  over = {"train.steps": 3, "data.verifier": "fbos_jax.testing.small:parity_reward"}
  tr = RLTrainer(small(spec, **over), str(tmp_path / "sync"), mesh=one_device_mesh)
  s_sync, _ = tr.train()
  tr.close()
  tr = AsyncRLTrainer(small(spec, **over), str(tmp_path / "async"), mesh=one_device_mesh)
  s_async, hist = tr.train()
  tr.close()
  for x, y in zip(jax.tree.leaves(jax.device_get(s_sync)), jax.tree.leaves(jax.device_get(s_async))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  ra, rb = (metrics_lib.read_jsonl(os.path.join(tmp_path, d, "metrics.jsonl"))
            for d in ("sync", "async"))
  assert [_drop(r) for r in ra] == [_drop(r) for r in rb]
  assert all(r["staleness/max"] == 0 and r["staleness/hist_0"] > 0 for r in rb)
  assert {"async/rollout_busy", "async/trainer_busy", "async/sync_s",
          "async/buffer_depth"} <= set(rb[-1])
