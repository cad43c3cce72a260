"""Shared config pieces. Algorithm files (grpo.py, gfpo.py, golf.py, fbos.py, fcp.py,
sft.py) start from :func:`get_base_config` and change only the fields that make
their algorithm; a model variant is chosen with ``:VARIANT`` on the command line:

  python launch/train.py --config=configs/fbos.py:tiny --workdir=/tmp/fbos_tiny
  python launch/train.py --config=configs/fbos.py:qwen_8b --dry_run --mesh_devices=32

Every field can be overridden, e.g. ``--config.rl.group_size=16``.
"""

import ml_collections as mlc

# ------------------------------------------------------------------ model presets
# Field names are ours (see fbos_jax/model/qwen.py:ModelConfig); HF checkpoints
# set them from config.json when --init_from_hf / model.hf_path is given.
MODEL_PRESETS = {
    # A ~0.4M-parameter Qwen3 that trains on a 2-core CPU in minutes; its vocab
    # covers the character tokenizer built by fbos_jax/tokenizer.py.
    "tiny": dict(model_type="qwen3", vocab_size=128, hidden_size=128, intermediate_size=384,
                 num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
                 rope_theta=10_000.0, rms_norm_eps=1e-6, tie_embeddings=True,
                 param_dtype="float32", compute_dtype="float32", remat="none"),
    # Qwen/Qwen3-0.6B.
    "qwen3_0_6b": dict(model_type="qwen3", vocab_size=151_936, hidden_size=1024,
                       intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
                       head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       tie_embeddings=True, param_dtype="bfloat16", compute_dtype="bfloat16",
                       remat="dots_no_batch"),
    # Qwen/Qwen3-8B (untied embeddings): 8,190,735,360 parameters.
    "qwen_8b": dict(model_type="qwen3", vocab_size=151_936, hidden_size=4096,
                    intermediate_size=12_288, num_layers=36, num_heads=32, num_kv_heads=8,
                    head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                    tie_embeddings=False, param_dtype="bfloat16", compute_dtype="bfloat16",
                    remat="full"),
}
MODEL_PRESETS["qwen_8b_h100"] = MODEL_PRESETS["qwen_8b"]

# mesh presets: sizes of (dcn, data, fsdp, tensor); -1 takes the remaining devices.
MESH_PRESETS = {
    "tiny": dict(dcn=1, data=-1, fsdp=1, tensor=1),
    "qwen3_0_6b": dict(dcn=1, data=1, fsdp=-1, tensor=1),
    # v5p-32/64-class pod: FSDP over the slice, 4-way tensor parallel inside a host.
    "qwen_8b": dict(dcn=1, data=1, fsdp=-1, tensor=4),
    # 8xH100 nodes: tensor parallel inside the node (NVLink), FSDP across nodes (dcn).
    "qwen_8b_h100": dict(dcn=-1, data=1, fsdp=1, tensor=8),
}

VARIANTS = tuple(MODEL_PRESETS)


def _rules():
  from fbos_jax.sharding import DEFAULT_RULES
  return [(k, list(v) if isinstance(v, tuple) else v) for k, v in DEFAULT_RULES]


def get_base_config(variant: str) -> mlc.ConfigDict:
  """The defaults of ALGORITHMS.md for every algorithm (FBOS-RL knobs off)."""
  if variant not in MODEL_PRESETS:
    raise ValueError(f"Unknown config variant {variant!r}; choose one of {sorted(MODEL_PRESETS)} "
                     "(e.g. --config=configs/fbos.py:tiny).")
  from fbos_jax.data import default_data_config

  c = mlc.ConfigDict()
  c.variant = variant
  c.algo = "grpo"  # a label for logs; behaviour comes from the fields below
  c.seed = 0

  c.model = mlc.ConfigDict(MODEL_PRESETS[variant])
  c.model.hf_path = ""  # a local HF checkpoint dir; empty = random init (tiny) / must set (large)
  c.model.tokenizer_path = ""  # empty = the HF dir, or the char tokenizer built in the workdir (tiny)

  c.mesh = mlc.ConfigDict(MESH_PRESETS[variant])
  c.mesh.rules = _rules()  # logical axis -> mesh axes (fbos_jax/sharding.py)
  c.mesh.num_devices = 0  # >0: plan for this many (abstract) devices in --dry_run

  c.data = default_data_config()
  from fbos_jax.templates import default_template_config
  c.templates = default_template_config()

  c.sampling = mlc.ConfigDict()
  c.sampling.max_new_tokens = 512
  c.sampling.temperature = 1.0  # log-probs are of the temperature-scaled policy
  c.sampling.top_k = 0  # 0 = off
  c.sampling.top_p = 1.0  # 1.0 = off
  c.sampling.batch_buckets = ()  # () = the sampler's default power-of-two row buckets
  c.sampling.prompt_buckets = (256, 512, 1024, 2048)
  c.sampling.fap_prompt_buckets = (512, 1024, 2048, 4096)  # round-2 (feedback) prompts
  # (the FAP/aggregated/FCP prompt budget is templates.max_prompt_tokens)
  c.sampling.eval_temperature = 0.0  # greedy held-out evaluation (pass@1)

  c.verifier = mlc.ConfigDict()
  # (which verifier: config.data.verifier, a registry name or "pkg.module:attr")
  c.verifier.timeout_s = 10.0
  c.verifier.workers = 4
  c.verifier.success_threshold = 1.0  # reward >= this counts as solved

  c.rl = mlc.ConfigDict()
  c.rl.objective = "policy_gradient"  # or "fcp" (feedback-conditional MLE, section 7)
  c.rl.prompts_per_step = 64
  c.rl.group_size = 8  # n: round-1 rollouts per prompt
  c.rl.advantage = "grpo"  # grpo | drgrpo | batch_std (section 1)
  c.rl.adv_eps = 1e-6
  c.rl.loss_agg = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
  c.rl.eps_low = 0.2
  c.rl.eps_high = 0.28  # clip-higher (DAPO)
  c.rl.dual_clip = 0.0  # 0 = off; else c (e.g. 3.0), applied where A < 0
  c.rl.kl_beta = 0.0  # >0 loads a frozen reference model
  c.rl.kl_kind = "k3"
  c.rl.entropy_coef = 0.0
  c.rl.ppo_epochs = 1
  c.rl.mini_batches = 1  # optimizer steps per rollout batch per epoch
  c.rl.micro_batches = 1  # gradient accumulation inside one optimizer step (exact token-mean)
  c.rl.fixed_row_buckets = False  # True: one update program per run (pad rows to the max)
  c.rl.skip_nonfinite = True  # skip (and log) a step whose loss/grad is not finite; False = fatal
  # --- feedback-guided exploration (round 2); off for GRPO/GFPO
  c.rl.round2 = False
  c.rl.round2_size = 8  # m: round-2 rollouts per prompt
  c.rl.fap_from = "failed"  # failed | all: which round-1 rollouts get a FAP
  c.rl.fap_mode = "single"  # single: FAP(q, o_i, F_i) | aggregated: GOLF's one prompt per q
  # --- EPA: feedback-guided rollouts pulled back onto q as off-policy samples
  c.rl.w_epa = 1.0
  c.rl.epa_select = "correct"  # correct | improved | all
  c.rl.epa_mode = "append"  # append (group grows) | replace (GOLF)
  c.rl.epa_trigger = "always"  # always | adaptive (only when round-1 mean reward < epa_tau)
  c.rl.epa_tau = -1.0  # -1 = 1/n
  c.rl.epa_max_per_prompt = 8  # cap on appended/replaced samples per prompt (static shapes)
  c.rl.offpolicy_lambda = 0.1  # f(u) = u / (u + lambda)
  c.rl.offpolicy_ratio_denominator = "one"  # one | behaviour
  # --- ECC: train the policy to use feedback, on the FAPs
  c.rl.w_ecc = 0.0
  c.rl.ecc_advantage = "group"  # group | improvement
  c.rl.objective_schedule = "joint"  # joint | alternate (EPA on even steps, ECC on odd)
  # --- GFPO
  c.rl.gfpo_k = 0  # 0 = off; keep k of G per group
  c.rl.gfpo_metric = "length"  # length | token_efficiency
  c.rl.gfpo_adaptive = False  # adaptive-difficulty k (k_map over difficulty buckets)
  c.rl.gfpo_k_map = (8, 8, 6, 4)  # very hard, hard, medium, easy (for G=16)
  c.rl.gfpo_history = 256
  # --- AReaL decoupled PPO (stale rollouts)
  c.rl.decoupled = False
  c.rl.staleness = 0  # eta: max policy versions a rollout may lag (0 = synchronous)
  c.rl.behav_weight_cap = 5.0
  # --- FCP
  c.rl.fcp_positive_feedback = "correct"  # c+ used to condition online samples

  c.optim = mlc.ConfigDict()
  c.optim.learning_rate = 1e-6
  c.optim.schedule = "constant"  # constant | cosine
  c.optim.warmup_steps = 10
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.weight_decay = 0.01
  c.optim.grad_clip = 1.0
  c.optim.opt_state_dtype = "float32"

  c.train = mlc.ConfigDict()
  c.train.steps = 200
  c.train.log_every = 1
  c.train.eval_every = 20
  c.train.eval_prompts = 128
  c.train.eval_k = 1  # pass@k with k samples per prompt at eval temperature
  c.train.checkpoint_every = 20
  c.train.keep_checkpoints = 3
  c.train.warm_start = ""  # "" | "sft" (train configs/sft.py first, cached in the workdir)
  c.train.progress = True

  c.sft = mlc.ConfigDict()
  c.sft.steps = 0
  c.sft.batch_size = 64
  c.sft.learning_rate = 1e-3
  c.sft.warmup_steps = 20
  c.sft.schedule = "cosine"  # cosine (to 0.1 x lr) | constant
  c.sft.fap_fraction = 0.0  # share of correction demos on FAPs (teaches the FAP format)
  c.sft.conditional = False  # FCP offline stage: train on <EF>c</EF>q -> o (c = feedback)
  return c


def apply_variant_defaults(c: mlc.ConfigDict) -> mlc.ConfigDict:
  """Run-size defaults per variant (tiny = this 2-core CPU, minutes)."""
  if c.variant == "tiny":
    c.data.source = "procedural"
    c.data.task = "sort"  # "sort 4701=" -> "0147"; feedback names misplaced/missing items
    # lists of 4-10 digits: a shared skill (not 100 memorised facts, like 1-digit sums)
    # with a held-out split of distinct problems at every length. After the warm start
    # the greedy answer is right on 56-73% of them but a T=1 sample only on 26-33%,
    # so most groups have mixed rewards and RL has a policy to sharpen. (2-digit sums
    # need a carry algorithm this model does not learn in minutes; RL cannot find it.)
    c.data.difficulty = 4
    c.data.max_difficulty = 10
    c.sampling.max_new_tokens = 12
    c.sampling.prompt_buckets = (16, 32)
    c.sampling.fap_prompt_buckets = (64, 128)
    c.templates.max_prompt_tokens = 128  # FAP / aggregated / FCP prompts fit the largest bucket
    c.verifier.workers = 2
    c.verifier.timeout_s = 5.0
    c.rl.prompts_per_step = 16
    c.rl.group_size = 8
    c.rl.round2_size = 8
    c.rl.fixed_row_buckets = True  # compiles cost more than padded rows at this size
    c.rl.epa_max_per_prompt = 8
    c.sampling.batch_buckets = (8, 16, 64, 128)  # prompts per sampler call: few programs
    # RL. Adam's step (about lr per coordinate) must stay inside the small region
    # where the policy-gradient loss still falls: 3e-4 already lowered the reward.
    c.optim.learning_rate = 1e-4
    c.optim.schedule = "cosine"
    c.optim.warmup_steps = 5
    c.optim.weight_decay = 0.0
    c.train.steps = 100  # the T=1 accuracy still climbs at 60 (README, "The tiny run")
    c.train.eval_every = 10
    c.train.eval_prompts = 256  # standard error of one greedy eval about 0.03
    c.train.eval_k = 4  # also pass@1 at temperature 1 (mean of 4) and pass@4
    c.train.checkpoint_every = 10
    c.train.warm_start = "sft"
    c.sft.steps = 100  # partial competence: the model sorts short lists, not long ones
    c.sft.batch_size = 64
    c.sft.learning_rate = 2e-3
    c.sft.fap_fraction = 0.25  # the same warm start serves every algorithm
  else:
    c.train.warm_start = ""
    # gradient accumulation so one micro-batch's activations fit (see --dry_run)
    c.rl.micro_batches = {"qwen3_0_6b": 4, "qwen_8b": 8, "qwen_8b_h100": 32}[c.variant]
    c.data.source = "jsonl"
    c.data.verifier = "math"
    c.templates.style = "verbose"
    c.templates.max_prompt_tokens = 4096
    c.optim.learning_rate = 1e-6
  return c


def parse_arg(arg: str, flavors: tuple = ()) -> tuple[str, tuple]:
  """'tiny' or 'tiny,drgrpo' -> ('tiny', ('drgrpo',)); unknown parts raise."""
  parts = [p for p in (arg or "tiny").split(",") if p]
  variant, extra = parts[0], tuple(parts[1:])
  bad = [e for e in extra if e not in flavors]
  if bad:
    raise ValueError(f"Unknown config flavor(s) {bad}; this file knows {list(flavors)} "
                     f"(e.g. :{variant},{flavors[0] if flavors else ''}).")
  return variant, extra
