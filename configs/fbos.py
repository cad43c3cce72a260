r"""FBOS-RL: feedback-driven bi-objective synergistic RL (ALGORITHMS.md section 6).

Round 1 samples n rollouts per prompt; the verifier's feedback builds
feedback-augmented prompts (FAPs); round 2 samples m rollouts from them; one
update combines EPA (the better feedback-guided rollouts pulled back onto q as
off-policy samples, f(u)=u/(u+lambda)) and ECC (PPO on the FAPs).

  python launch/train.py --config=configs/fbos.py:tiny --workdir=/tmp/fbos_tiny
  python launch/train.py --config=configs/fbos.py:qwen_8b --dry_run --mesh_devices=32
  python launch/train.py --config=configs/fbos.py:tiny,epa_only --workdir=...   # ablation
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import base  # noqa: E402


def get_config(arg="tiny"):
  variant, flavors = base.parse_arg(arg, ("epa_only", "ecc_only", "behaviour", "aggregated"))
  c = base.apply_variant_defaults(base.get_base_config(variant))
  c.algo = "fbos"
  c.rl.round2 = True  # feedback-guided exploration
  c.rl.fap_from = "failed"
  c.rl.fap_mode = "single"
  c.rl.epa_select = "correct"
  c.rl.epa_mode = "append"
  c.rl.epa_trigger = "always"
  c.rl.w_epa = 1.0
  c.rl.w_ecc = 1.0
  c.rl.ecc_advantage = "group"
  c.rl.objective_schedule = "joint"
  c.rl.offpolicy_lambda = 0.1
  c.rl.offpolicy_ratio_denominator = "one"
  if variant == "tiny":
    # same generated-rollout budget per step as GRPO's 16 x 8: 8 prompts x (8 + 8)
    c.rl.prompts_per_step = 8
  if "epa_only" in flavors:
    c.rl.w_ecc = 0.0
  if "ecc_only" in flavors:
    c.rl.w_epa = 0.0
  if "behaviour" in flavors:
    c.rl.offpolicy_ratio_denominator = "behaviour"
  if "aggregated" in flavors:
    c.rl.fap_mode = "aggregated"
  return c
