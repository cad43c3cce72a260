r"""FBOS-RL: feedback-driven bi-objective synergistic RL (ALGORITHMS.md section 6).

Round 1 samples n rollouts per prompt; the verifier's feedback builds
feedback-augmented prompts (FAPs); round 2 samples m rollouts from them; one
update combines EPA (the better feedback-guided rollouts pulled back onto q as
off-policy samples, f(u)=u/(u+lambda)) and ECC (PPO on the FAPs).

  python launch/train.py --config=configs/fbos.py:tiny --workdir=/tmp/fbos_tiny
  python launch/train.py --config=configs/fbos.py:qwen_8b --dry_run --topology=v5p:2x4x4
  python launch/train.py --config=configs/fbos.py:tiny,epa_only --workdir=...   # ablation

The default is the paper's recipe as ALGORITHMS.md section 6 sets it (EPA and
ECC at weight 1, every better feedback-guided rollout appended, f(u) with
u = pi_theta). It is not yet chosen from the pre-registered ablation below
(issue 16): that needs 27 runs of 10-20 minutes each on the 2-core machine, and
only part of seed 0 has run (README, "Where feedback pays"). What has been
measured argues for no arm in particular: on the tiny tasks a FAP fixes fewer
failures than sampling q again (0.11 against 0.35 after the warm start), so
neither term has much to work with.

Flavors (ablation arms; launch/compare.py --ablations runs them side by side):

  epa_only      rl.terms.ecc.weight=0 (no ECC term)
  ecc_only      rl.terms.epa.weight=0 (no EPA term)
  behaviour     rl.offpolicy_ratio_denominator=behaviour (u = pi_theta / pi_old(.|FAP))
  aggregated    rl.fap_mode=aggregated (GOLF's one prompt over the failed attempts)
  adaptive_one  rl.epa_trigger=adaptive, rl.epa_max_per_prompt=1 (inject one
                feedback-guided sample, only where round 1 has no success: GOLF's rule)
  ecc_quarter   rl.terms.ecc.weight=0.25
  alternate     rl.objective_schedule=alternate (EPA on even steps, ECC on odd)
  fap_all       rl.fap_from=all (FAPs from every round-1 rollout, not only failures)
  prompts16     the variant's prompts per step (16 on tiny) instead of half: twice the
                rollouts per step, so compare it at equal steps, not equal rollouts
"""
from configs import base

# Each flavor is a set of field overrides (ablation arms of issue 16).
FLAVOR_FIELDS = {
    "epa_only": {"rl.terms.ecc.weight": 0.0},
    "ecc_only": {"rl.terms.epa.weight": 0.0},
    "behaviour": {"rl.offpolicy_ratio_denominator": "behaviour"},
    "aggregated": {"rl.fap_mode": "aggregated"},
    # tau = rl.epa_tau (-1: 1/n, i.e. no round-1 success)
    "adaptive_one": {"rl.epa_trigger": "adaptive", "rl.epa_max_per_prompt": 1},
    "ecc_quarter": {"rl.terms.ecc.weight": 0.25},
    "alternate": {"rl.objective_schedule": "alternate"},
    "fap_all": {"rl.fap_from": "all"},
    "prompts16": {},  # keeps the variant's prompts per step (below)
}
FLAVORS = tuple(FLAVOR_FIELDS)


def get_config(arg="tiny"):
  c, flavors = base.get_config_for(arg, FLAVORS)
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
  if c.variant in base.EQUAL_ROLLOUT_VARIANTS and "prompts16" not in flavors:
    c.rl.prompts_per_step = c.rl.prompts_per_step // 2
  for flavor in flavors:
    for dotted, value in FLAVOR_FIELDS.get(flavor, {}).items():
      base.set_field(c, dotted, value)
  return base.apply_common_flavors(c, flavors)
