r"""GOLF: group-level feedback aggregated into one refinement prompt, adaptive
injection of a correct refinement (off-policy, f(u)), joint refinement training,
Dr.GRPO advantages (ALGORITHMS.md section 5). A configuration of the FBOS loop.

  python launch/train.py --config=configs/golf.py:tiny --workdir=/tmp/golf_tiny
"""
from configs import base


def get_config(arg="tiny"):
  c, flavors = base.get_config_for(arg, ())
  c.algo = "golf"
  c.rl.advantage = "drgrpo"
  c.rl.round2 = True
  c.rl.fap_from = "failed"
  c.rl.fap_mode = "aggregated"  # one prompt per q over its failed attempts
  c.rl.round2_size = c.rl.group_size  # m = n refinements
  c.rl.epa_select = "correct"
  c.rl.epa_mode = "replace"  # a correct refinement replaces a failed rollout
  c.rl.epa_trigger = "adaptive"  # only when round-1 mean reward < tau
  c.rl.epa_tau = -1.0  # = 1/n
  c.rl.epa_max_per_prompt = 1
  c.rl.terms.epa.weight = 1.0
  c.rl.terms.ecc.weight = 1.0  # the refinements' own on-policy group (joint training)
  c.rl.ecc_advantage = "group"
  # round 2 doubles the rollouts of a step: half the prompts keep the budget equal
  if c.variant == "tiny":  # the comparisons run at equal rollouts per step
    c.rl.prompts_per_step = c.rl.prompts_per_step // 2
  return base.apply_common_flavors(c, flavors)
