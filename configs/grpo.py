r"""GRPO (and Dr.GRPO): the baselines. Round 1 only, PPO clip, group-normalised advantages.

  python launch/train.py --config=configs/grpo.py:tiny --workdir=/tmp/grpo_tiny
  python launch/train.py --config=configs/grpo.py:tiny,drgrpo --workdir=/tmp/drgrpo_tiny
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import base  # noqa: E402


def get_config(arg="tiny"):
  variant, flavors = base.parse_arg(arg, ("drgrpo",))
  c = base.apply_variant_defaults(base.get_base_config(variant))
  c.algo = "grpo"
  if "drgrpo" in flavors:
    c.algo = "drgrpo"
    c.rl.advantage = "drgrpo"  # A = r - mean, no std
    c.rl.loss_agg = "seq-mean-token-sum-norm"  # divide by a constant length, not |o|
  return c
