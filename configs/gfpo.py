r"""GFPO: sample a larger group, keep the top k by a metric, baseline over the kept subset.

  python launch/train.py --config=configs/gfpo.py:tiny --workdir=/tmp/gfpo_tiny          # shortest k/G
  python launch/train.py --config=configs/gfpo.py:tiny,token_efficiency --workdir=...    # reward/length
  python launch/train.py --config=configs/gfpo.py:tiny,adaptive --workdir=...            # adaptive difficulty
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import base  # noqa: E402


def get_config(arg="tiny"):
  variant, flavors = base.parse_arg(arg, ("token_efficiency", "adaptive"))
  c = base.apply_variant_defaults(base.get_base_config(variant))
  c.algo = "gfpo"
  c.rl.group_size = 16  # G: the larger sampled group
  c.rl.gfpo_k = 8  # k kept per group (shortest by default)
  c.rl.gfpo_metric = "length"
  if "token_efficiency" in flavors:
    c.rl.gfpo_metric = "token_efficiency"
  if "adaptive" in flavors:
    c.rl.gfpo_adaptive = True  # k from difficulty buckets of a rolling history
    c.rl.gfpo_k_map = (8, 8, 6, 4)
  if variant == "tiny":
    c.rl.prompts_per_step = 8  # same rollouts per step as the other tiny configs (8 x 16)
  return c
