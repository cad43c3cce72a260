r"""GFPO: sample a larger group, keep the top k by a metric, baseline over the kept subset.

  python launch/train.py --config=configs/gfpo.py:tiny --workdir=/tmp/gfpo_tiny          # shortest k/G
  python launch/train.py --config=configs/gfpo.py:tiny,token_efficiency --workdir=...    # reward/length
  python launch/train.py --config=configs/gfpo.py:tiny,adaptive --workdir=...            # adaptive difficulty
"""
from configs import base


def get_config(arg="tiny"):
  c, flavors = base.get_config_for(arg, ("token_efficiency", "adaptive"))
  c.algo = "gfpo"
  c.rl.group_size = 16  # G: the larger sampled group
  c.rl.gfpo_k = 8  # k kept per group (shortest by default)
  c.rl.gfpo_metric = "length"
  if "token_efficiency" in flavors:
    c.rl.gfpo_metric = "token_efficiency"
  if "adaptive" in flavors:
    c.rl.gfpo_adaptive = True  # k from difficulty buckets of a rolling history
    c.rl.gfpo_k_map = (8, 8, 6, 4)
  # G = 16 at half the prompts: the same rollouts per step as the other algorithms
  if c.variant in base.EQUAL_ROLLOUT_VARIANTS:  # the comparisons run at equal rollouts per step
    c.rl.prompts_per_step = c.rl.prompts_per_step // 2
  return base.apply_common_flavors(c, flavors)
