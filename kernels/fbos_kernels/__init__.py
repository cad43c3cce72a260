"""fbos_kernels: pure-JAX advantage, loss, aggregation and log-prob kernels for RL post-training.

Depends on ``jax`` alone. Every function is pure and works under ``jit``,
``vmap`` and ``grad``. See ``kernels/README.md`` for the conventions.

Install: ``pip install ./kernels`` (distribution ``fbos-kernels``); import as
``fbos_kernels`` (the PyPI name ``kernels`` belongs to an unrelated project).
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    batch_std_advantages,
    drgrpo_advantages,
    get_advantage_estimator,
    group_advantages,
    group_stats,
    grpo_advantages,
)
from .aggregation import (
    AGGREGATION_MODES,
    aggregate,
    aggregate_loss,
    masked_mean,
    masked_sum,
    safe_divide,
)
from .gfpo import (
    GFPO_METRICS,
    AdaptiveKState,
    adaptive_k,
    adaptive_k_init,
    gfpo_advantages,
    gfpo_keep_mask,
    gfpo_loss_mask,
    gfpo_scores,
    masked_percentile,
)
from .logprobs import (
    logprob_stats,
    naive_logprobs_and_entropy,
    token_logprobs_and_entropy,
    vocab_parallel_logprobs_and_entropy,
)
from .losses import (
    ADVANTAGE_LOSSES,
    KL_ESTIMATORS,
    LOG_RATIO_CLAMP,
    POLICY_LOSSES,
    RATIO_DENOMINATORS,
    decoupled_ppo_loss,
    entropy_from_logits,
    get_policy_loss,
    kl_penalty,
    mle_loss,
    offpolicy_loss,
    policy_loss,
    ppo_clip_loss,
    reshaped_ratio,
)

__version__ = "0.1.0"

__all__ = [
    # advantages
    "group_advantages", "grpo_advantages", "drgrpo_advantages", "batch_std_advantages", "group_stats",
    "ADVANTAGE_ESTIMATORS", "get_advantage_estimator",
    # gfpo
    "gfpo_scores", "gfpo_keep_mask", "gfpo_advantages", "gfpo_loss_mask", "AdaptiveKState",
    "adaptive_k_init", "adaptive_k", "masked_percentile", "GFPO_METRICS",
    # losses
    "ppo_clip_loss", "offpolicy_loss", "reshaped_ratio", "policy_loss", "decoupled_ppo_loss", "mle_loss", "kl_penalty",
    "entropy_from_logits", "POLICY_LOSSES", "get_policy_loss", "LOG_RATIO_CLAMP",
    "ADVANTAGE_LOSSES", "KL_ESTIMATORS", "RATIO_DENOMINATORS",
    # aggregation
    "aggregate", "aggregate_loss", "safe_divide", "masked_mean", "masked_sum", "AGGREGATION_MODES",
    # logprobs
    "token_logprobs_and_entropy", "naive_logprobs_and_entropy", "vocab_parallel_logprobs_and_entropy",
    "logprob_stats",
]
