r"""Supervised warm start on verifier-checked demonstrations of the procedural tasks.

The tiny RL configs run this automatically (train.warm_start='sft') and cache
the result in WORKDIR/sft; it can also be run alone:

  python launch/train.py --config=configs/sft.py:tiny --workdir=/tmp/sft_tiny
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import base  # noqa: E402


def get_config(arg="tiny"):
  variant, _ = base.parse_arg(arg, ())
  c = base.apply_variant_defaults(base.get_base_config(variant))
  c.algo = "sft"
  c.train.steps = 0  # no RL; only the warm start
  c.train.warm_start = "sft"
  return c
