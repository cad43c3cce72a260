r"""Supervised warm start on verifier-checked demonstrations of the procedural tasks.

The tiny RL configs run this automatically (train.warm_start='sft') and cache
the result in WORKDIR/sft; it can also be run alone:

  python launch/train.py --config=configs/sft.py:tiny --workdir=/tmp/sft_tiny
"""
from configs import base


def get_config(arg="tiny"):
  c, flavors = base.get_config_for(arg, ())
  c.algo = "sft"
  c.train.steps = 0  # no RL; only the warm start
  c.train.warm_start = "sft"
  return base.apply_common_flavors(c, flavors)
