r"""FBOS-RL: feedback-driven bi-objective synergistic RL (ALGORITHMS.md section 6).

Round 1 samples n rollouts per prompt; the verifier's feedback builds
feedback-augmented prompts (FAPs); round 2 samples m rollouts from them; one
update combines EPA (the better feedback-guided rollouts pulled back onto q as
off-policy samples, f(u)=u/(u+lambda)) and ECC (PPO on the FAPs).

  python launch/train.py --config=configs/fbos.py:tiny --workdir=/tmp/fbos_tiny
  python launch/train.py --config=configs/fbos.py:qwen_8b --dry_run --topology=v5p:2x4x4
  python launch/train.py --config=configs/fbos.py:tiny,epa_only --workdir=...   # ablation
"""
from configs import base


def get_config(arg="tiny"):
  c, flavors = base.get_config_for(arg, ("epa_only", "ecc_only", "behaviour", "aggregated"))
  c.algo = "fbos"
  c.rl.round2 = True  # feedback-guided exploration
  c.rl.fap_from = "failed"
  c.rl.fap_mode = "single"
  c.rl.epa_select = "correct"
  c.rl.epa_mode = "append"
  c.rl.epa_trigger = "always"
  c.rl.terms.epa.weight = 1.0
  c.rl.terms.ecc.weight = 1.0
  c.rl.ecc_advantage = "group"
  c.rl.objective_schedule = "joint"
  c.rl.offpolicy_lambda = 0.1
  c.rl.offpolicy_ratio_denominator = "one"
  # n + m rollouts per prompt: half the prompts of GRPO for the same rollouts per step
  if c.variant == "tiny":  # the comparisons run at equal rollouts per step
    c.rl.prompts_per_step = c.rl.prompts_per_step // 2
  if "epa_only" in flavors:
    c.rl.terms.ecc.weight = 0.0
  if "ecc_only" in flavors:
    c.rl.terms.epa.weight = 0.0
  if "behaviour" in flavors:
    c.rl.offpolicy_ratio_denominator = "behaviour"
  if "aggregated" in flavors:
    c.rl.fap_mode = "aggregated"
  return base.apply_common_flavors(c, flavors)
