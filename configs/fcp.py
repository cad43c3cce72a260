r"""FCP: the feedback-conditional policy (ALGORITHMS.md section 7). No advantages:
maximum likelihood of o given <EF>c</EF>q. The offline stage is SFT on
(q, o, c) triples; the online bootstrap samples under a positive c+, gets fresh
feedback c and takes an MLE step on (q, o, c).

  python launch/train.py --config=configs/fcp.py:tiny --workdir=/tmp/fcp_tiny          # offline + online
  python launch/train.py --config=configs/fcp.py:tiny,offline --workdir=...            # offline only
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import base  # noqa: E402


def get_config(arg="tiny"):
  variant, flavors = base.parse_arg(arg, ("offline",))
  c = base.apply_variant_defaults(base.get_base_config(variant))
  c.algo = "fcp"
  c.rl.objective = "fcp"
  c.rl.fcp_positive_feedback = "correct"
  c.sft.conditional = True  # the offline stage trains on <EF>c</EF>q -> o triples
  if "offline" in flavors:
    c.train.steps = 0
  return c
