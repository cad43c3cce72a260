r"""GRPO (and Dr.GRPO): the baselines. Round 1 only, PPO clip, group-normalised advantages.

  python launch/train.py --config=configs/grpo.py:tiny --workdir=/tmp/grpo_tiny
  python launch/train.py --config=configs/grpo.py:tiny,drgrpo --workdir=/tmp/drgrpo_tiny
"""
from configs import base


def get_config(arg="tiny"):
  c, flavors = base.get_config_for(arg, ("drgrpo",))
  c.algo = "grpo"
  if "drgrpo" in flavors:
    c.algo = "drgrpo"
    c.rl.advantage = "drgrpo"  # A = r - mean, no std
    c.rl.loss_agg = "seq-mean-token-sum-norm"  # divide by a constant length, not |o|
  return base.apply_common_flavors(c, flavors)
