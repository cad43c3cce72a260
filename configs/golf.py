r"""GOLF: group-level feedback aggregated into one refinement prompt, adaptive
injection of a correct refinement (off-policy, f(u)), joint refinement training,
Dr.GRPO advantages (ALGORITHMS.md section 5). A configuration of the FBOS loop.

  python launch/train.py --config=configs/golf.py:tiny --workdir=/tmp/golf_tiny

The algorithm fields follow GOLF's released math recipe (LuckyyySTA/GOLF at
5dc53b5b, ``exp_scripts/critique_grpo_hybrid_math.sh``; line numbers below):

* Dr.GRPO advantages, r - mean (L96, L163); no KL (kl_beta 0), no entropy bonus
  (entropy_coef 0, L189);
* PPO clip 0.2 / 0.2, no clip-higher (L98-99); dual clip c = 10 on the on-policy
  tokens with A < 0 (L171; off-policy rows take f(u), never clipped);
* ``seq-mean-token-sum-norm`` with L = the padded response width (L107, L71:
  ``rl.loss_agg``; ``norm_len`` 0 = the response bucket, sampling.max_new_tokens);
* m = n refinements (L111), from one prompt over q's failed attempts only (L87);
* injection only where round 1 has no success: mean reward < 0.125 with n = 8
  (L76; ``rl.epa_tau=-1`` is 1/n, which is "no success" for binary rewards at
  any n), one injected sample (L64) replacing a random failed slot with a random
  correct refinement (``epa_mode=replace``);
* f(u) = u / (u + 0.1) with u = pi_theta (L69: ``offpolicy_lambda=0.1``,
  ``offpolicy_ratio_denominator=one``);
* refinements sampled at the round-1 settings (temperature 1.0, top-p 1.0): L86
  states top-p 0.9 for refinements, but the hybrid code path does not pass it to
  the sampler, and our round 2 uses the round-1 sampling settings too.

Kept different, with the reason:

* feedback: GOLF's math critique reveals the ground truth (L83
  ``critique_type='answer'``); we keep ``data.feedback_reveals_answer`` off, as
  for every algorithm here (ALGORITHMS.md section 6: feedback says what and where,
  not the answer).
* prompts whose round 1 is all correct: GOLF samples refinements for them too and
  zeroes their rewards, so they only enter the row counts of the loss
  denominators (and the rollout count); we sample no round 2 for them.
* the loss denominators: GOLF trains the original groups and the refinement groups
  as one batch; here they are two terms (``epa``, ``ecc``), each over its own rows,
  weights 1 and 1. Our ``seq-mean-token-sum-norm`` also divides by the number of
  sequences (the Dr.GRPO paper's 1/(G L)); verl divides the token sum by L only,
  a constant factor that Adam removes except through gradient clipping.
* run sizes stay those of the variant table, shared by every algorithm so that a
  comparison changes the algorithm only: prompts per step (GOLF: 128, ~4 optimizer
  steps per RL step in mini-batches of 64 prompts; tiny: 8 prompts, one step, at
  the rollouts per step of GRPO), n = 8 on tiny, learning rate, and the optimizer:
  weight decay 0.1 (L185) and no LR warm-up (L184) in GOLF, the variant's values
  here (tiny: 0.0 and 5 steps).
* the aggregated prompt's budget is ``templates.max_prompt_tokens``, sized to hold
  the task's longest single FAP (tiny: 656 tokens), so on tiny it holds every
  failed attempt of a prompt, as GOLF's prompt length does for math.
"""
from configs import base


def get_config(arg="tiny"):
  c, flavors = base.get_config_for(arg, ())
  c.algo = "golf"
  c.rl.advantage = "drgrpo"
  c.rl.kl_beta = 0.0
  c.rl.entropy_coef = 0.0
  c.rl.eps_low = 0.2
  c.rl.eps_high = 0.2  # no clip-higher
  c.rl.dual_clip = 10.0  # on-policy tokens with A < 0
  c.rl.loss_agg = "seq-mean-token-sum-norm"  # L = the padded response width
  c.rl.round2 = True
  c.rl.fap_from = "failed"
  c.rl.fap_mode = "aggregated"  # one prompt per q over its failed attempts
  c.rl.round2_size = c.rl.group_size  # m = n refinements
  c.rl.epa_select = "correct"
  c.rl.epa_mode = "replace"  # a correct refinement replaces a failed rollout
  c.rl.epa_trigger = "adaptive"  # only when round-1 mean reward < tau
  c.rl.epa_tau = -1.0  # = 1/n: no round-1 success
  c.rl.epa_max_per_prompt = 1
  c.rl.offpolicy_lambda = 0.1
  c.rl.offpolicy_ratio_denominator = "one"  # u = pi_theta
  c.rl.terms.epa.weight = 1.0
  c.rl.terms.ecc.weight = 1.0  # the refinements' own on-policy group (joint training)
  c.rl.ecc_advantage = "group"
  # round 2 doubles the rollouts of a step: half the prompts keep the budget equal
  if c.variant in base.EQUAL_ROLLOUT_VARIANTS:  # the comparisons run at equal rollouts per step
    c.rl.prompts_per_step = c.rl.prompts_per_step // 2
  return base.apply_common_flavors(c, flavors)
