r"""FCP: the feedback-conditional policy (ALGORITHMS.md section 7). No advantages:
maximum likelihood of o given <EF>c</EF>q. The offline stage is SFT on
(q, o, c) triples; the online bootstrap samples under a positive c+, gets fresh
feedback c and takes an MLE step on (q, o, c).

  python launch/train.py --config=configs/fcp.py:tiny --workdir=/tmp/fcp_tiny          # offline + online
  python launch/train.py --config=configs/fcp.py:tiny,offline --workdir=...            # offline only
"""
from configs import base


def get_config(arg="tiny"):
  c, flavors = base.get_config_for(arg, ("offline",))
  c.algo = "fcp"
  c.rl.prompt = "fcp"  # round 1 and the eval sample under <EF>c+</EF>q
  c.rl.fcp_positive_feedback = "correct"
  c.rl.terms.epa.weight = 0.0
  c.rl.terms.fcp.weight = 1.0  # MLE of o given <EF>c</EF>q, c the fresh feedback
  c.sft.conditional = True  # the offline stage trains on <EF>c</EF>q -> o triples
  if "offline" in flavors:
    c.train.steps = 0
  return base.apply_common_flavors(c, flavors)
