"""A subprocess of tests/test_async.py: the 4 / 4 split at eta = 2 for 6 steps with a
checkpoint every 2, killed with SIGKILL right after step ``kill_after`` (-1: never).

  python tests/async_kill_worker.py WORKDIR KILL_AFTER
"""
import os
import signal
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(workdir: str, kill_after: int):
  from fbos_jax.rl.trainer import RLTrainer
  from fbos_jax.testing.small import small_config
  c = small_config("configs/fbos.py:tiny", **{
      "train.steps": 6, "train.checkpoint_every": 2, "rl.rollout_devices": 4,
      "rl.max_staleness": 2, "data.verifier": "fbos_jax.testing.small:parity_reward"})
  tr = RLTrainer(c, workdir)

  def on_step(s, state, m):
    if s == kill_after:
      tr.ckpt.wait()  # the checkpoint of step 2 is on disk; step 3's is never written
      os.kill(os.getpid(), signal.SIGKILL)

  tr.train(on_step=on_step)
  tr.close()
  print("done", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
