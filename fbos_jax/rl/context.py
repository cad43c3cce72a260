"""The run's parts in one object: typed configs, mesh, tokenizer, prompts, verifiers, one ``sample``.

A :class:`RolloutContext` is built once per run (:meth:`RolloutContext.build`)
and handed to the rollout phases, the evaluation, the SFT warm start and the
export check. It holds:

* ``parts``: the typed configs of :func:`fbos_jax.rl.config.build_parts`
  (model, the sampler settings of each call kind, the rollout spec, the
  update, the optimizer);
* the mesh and its logical rules;
* the tokenizer, the prompt builder (``fbos_jax/templates.py``) and the
  verifier pool (``fbos_jax/verifiers/base.py``);
* the bound of the feedback prompts this task can produce (``fap_budget``).

:meth:`RolloutContext.sample` is the one sampler call of the project: every
caller names the kind of call (``parts.sampling.round1`` / ``round2`` /
``eval`` / ``eval_sampled``) and gets decoded texts with the tokens, and the
policy version of every token when ``params`` is a
:class:`~fbos_jax.engine.ParamsSource`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np

from fbos_jax import buckets
from fbos_jax import sharding as sh
from fbos_jax import templates
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import state as state_lib


class Samples(NamedTuple):
  """n samples per context, prompt-major (row ``i * n + j``: sample j of context i).

  tokens [N, R] int32, mask [N, R] int32 (1 on generated tokens, stop included),
  logp [N, R] float32 (the sampler's log-probs), lengths [N] int32, texts [N] str,
  versions [N, R] int64 (the policy version of each token, -1 off the mask; -1
  everywhere for params without a version)."""
  tokens: np.ndarray
  mask: np.ndarray
  logp: np.ndarray
  lengths: np.ndarray
  texts: list
  versions: np.ndarray


class DecodeError(ValueError):
  """A sampled id the tokenizer does not have (never silently dropped)."""


# what a user does about a prompt too long for its budget (every such error says it)
OVER_LONG_HINT = ("raise the budget, or drop such records at load with "
                  "--config.data.max_prompt_tokens=N (data.over_long=filter)")


def check_engine_pools(parts: config_lib.RunParts, mesh=None, rules=None, *, probe=False):
  """With ``sampling.engine=continuous``: the page pool of each kind of sampler call
  a run makes (``fbos_jax.rl.shapes.sampler_calls``; round 2's too with the probe)
  fits ``engine.num_pages`` and the mesh (``fbos_jax.engine.runner.pool_layout``):
  checked when the run is built, not at the first engine call (mid warm start).
  Raises EngineError naming the fields and the call."""
  sp = parts.sampling
  if sp.engine != "continuous":
    return
  from fbos_jax import sampling as sampling_lib
  from fbos_jax.engine import runner
  from fbos_jax.rl import shapes
  shards = sh.batch_shard_count(mesh, rules) if mesh is not None else 1
  calls = {name: scfg for name, (_, _, scfg) in
           shapes.sampler_calls(parts, eval_prompts=1, eval_k=2).items()}
  if probe:
    calls.setdefault("sample_round2", sp.round2)
  for name, scfg in calls.items():
    try:
      runner.pool_layout(shapes.engine_config(parts), scfg, shards,
                         sampling_lib.mesh_processes(mesh))
    except runner.EngineError as e:
      raise runner.EngineError(f"the continuous engine's {name} calls: {e}") from None


class RolloutContext:
  """Everything the host side of a step needs, built once (see the module doc)."""

  def __init__(self, parts: config_lib.RunParts, *, tokenizer, prompt_builder, pool, mesh=None,
               rules=None, fap_budget: Optional[dict] = None):
    self.parts = parts
    self.spec = parts.rollout
    self.model_cfg = parts.model
    self.tokenizer = tokenizer
    self.prompts = prompt_builder
    self.pool = pool
    self.mesh = mesh
    self.rules = rules if rules is not None else dict(sh.DEFAULT_RULES)
    self.fap_budget = fap_budget
    self.pad_id = parts.sampling.round1.pad_id
    self.stop_ids = tuple(parts.sampling.round1.stop_token_ids)
    self.threshold = parts.rollout.success_threshold
    self.engine_stats = None  # an EngineStats the continuous engine's calls add to

  @classmethod
  def build(cls, config, workdir: str, *, mesh=None, tokenizer=None, verifier=None,
            check_budget: bool = True, with_pool: bool = True) -> "RolloutContext":
    """The context of ``config``: loads (or takes) the tokenizer, checks it
    against the model and template, builds the typed parts, the prompt builder
    and (``with_pool``) the verifier pool, and checks the FAP budget
    (``check_budget``)."""
    from fbos_jax import tokenizer as tok_lib
    from fbos_jax.rl import fap_budget as budget_lib
    from fbos_jax.verifiers.base import VerifierPool, make_verifier
    if tokenizer is None:
      tok_path = tok_lib.resolve_tokenizer_path(config, workdir)  # tiny: the char tokenizer
      tokenizer = tok_lib.load_tokenizer(tok_path)
      tok_lib.check_tokenizer_compat(tokenizer, vocab_size=config.model.vocab_size,
                                     template_style=config.templates.style,
                                     tokenizer_path=tok_path)
    if len(tokenizer) > int(config.model.vocab_size):
      raise ValueError(f"model.vocab_size={config.model.vocab_size} is smaller than the "
                       f"tokenizer's {len(tokenizer)} tokens")
    parts = config_lib.build_parts(config, pad_id=int(tokenizer.pad_token_id),
                                   eos_id=int(tokenizer.eos_token_id),
                                   vocab_limit=len(tokenizer))
    vc, pool = config.verifier, None
    if with_pool:
      pool = VerifierPool(verifier if verifier is not None else make_verifier(config.data),
                          num_workers=vc.workers, timeout_s=vc.timeout_s, backend=vc.backend,
                          reward_range=tuple(vc.reward_range),
                          max_abandoned_threads=vc.max_abandoned_threads)
    check_engine_pools(parts, mesh, sh.rules_dict(config.mesh.rules),
                       probe=bool(config.train.get("probe_every", 0)))
    budget = None
    if check_budget:
      from fbos_jax.verifiers import procedural
      budget = budget_lib.check_fap_budget(config, parts, tokenizer)
      if pool is not None:  # data.require_hidden_answer=True: refuse such a task now
        procedural.check_config_answer_hidden(config, pool.verifier)
    return cls(parts, tokenizer=tokenizer,
               prompt_builder=templates.PromptBuilder(tokenizer, config.templates), pool=pool,
               mesh=mesh, rules=sh.rules_dict(config.mesh.rules), fap_budget=budget)

  # ----------------------------------------------------------------- prompts
  def prompt_ids(self, example) -> list:
    """The round-1 (and eval) context of an example: q, or <EF>c+</EF>q
    (``rl.prompt=fcp``). A prompt too long for the template budget or the
    largest round-1 prompt bucket raises, naming the record (file:line and id)
    and the fields that decide it."""
    return self.checked_prompt_ids(
        example, max(self.parts.sampling.round1.prompt_buckets),
        conditional=self.spec.conditional, positive_feedback=self.spec.fcp_positive_feedback)

  def checked_prompt_ids(self, example, longest: int, *, conditional: bool = False,
                         positive_feedback: str = "correct", who: str = "",
                         buckets_field: str = "sampling.prompt_buckets") -> list:
    """q's ids (``conditional``: the FCP prompt with ``positive_feedback``), or a
    BucketError naming the record (file:line and id) when it does not fit the
    template budget or ``longest`` tokens (the largest of ``buckets_field``)."""
    from fbos_jax import data as data_lib
    hint = OVER_LONG_HINT
    where = f"{who}the prompt of {data_lib.locate(example)}"
    try:
      ids = (self.prompts.fcp(example["prompt"], positive_feedback) if conditional
             else self.prompts.plain(example["prompt"])).token_ids
    except templates.PromptTooLongError as e:
      raise buckets.BucketError(f"{where}: {e} (templates.max_prompt_tokens); {hint}") from None
    if len(ids) > longest:
      raise buckets.BucketError(f"{where} has {len(ids)} tokens, more than the largest "
                                f"{buckets_field}={longest}; {hint}")
    return ids

  # ----------------------------------------------------------------- text
  def decode(self, tokens: np.ndarray, lengths: np.ndarray) -> list:
    """Response texts of sampled rows [N, R] (up to their lengths; stop ids and
    special tokens left out). An id the tokenizer does not have raises
    :class:`DecodeError`: the verifier must see the tokens the update trains on."""
    known = len(self.tokenizer)
    out = []
    for i, (row, n) in enumerate(zip(np.asarray(tokens), np.asarray(lengths))):
      ids = [int(t) for t in row[:int(n)]]
      bad = [t for t in ids if not 0 <= t < known]
      if bad:
        raise DecodeError(f"sampled row {i} holds id(s) {sorted(set(bad))[:5]} that the "
                          f"tokenizer ({known} tokens) does not have; the sampler's "
                          f"vocab_limit must be the tokenizer's size")
      out.append(self.tokenizer.decode([t for t in ids if t not in self.stop_ids],
                                       skip_special_tokens=True))
    return out

  def verify(self, examples: Sequence, texts: Sequence[str]):
    """Verdicts of the pool (timeouts, fault isolation, reward range) as
    (rewards [N] float32, feedback [N] str, is_error [N] bool, pool stats).
    An error verdict's reward is a placeholder and its feedback is empty."""
    if not len(texts):
      return np.zeros(0, np.float32), [], np.zeros(0, bool), {}
    verdicts, stats = self.pool.run(list(examples), list(texts))
    rewards = np.asarray([v.reward for v in verdicts], np.float32)
    errors = np.asarray([v.is_error for v in verdicts], bool)
    return rewards, [v.feedback for v in verdicts], errors, stats

  # ----------------------------------------------------------------- sampling
  def sample(self, params, contexts: list, n: int, key, sampling, stream_ids=None) -> Samples:
    """n samples of each context under ``sampling`` (one of ``parts.sampling``'s
    configs): the one sampler call of the project (rollout rounds, eval, SFT's
    own failures, the export check), on the static sampler or the continuous
    engine (``sampling.engine``; the same key contract and output). Contexts may
    be empty on every process (0 rows).

    ``params``: the policy in ``model.compute_dtype``
    (:class:`fbos_jax.rl.state.ComputeCopy`; handed the master of another dtype it
    raises) with versions -1, or a ParamsSource (published compute copies and their
    version): the static sampler reads it once per call, the engine between decode
    windows (in-flight weight updates, ``fbos_jax/engine/runner.py``)."""
    from fbos_jax import sampling as sampling_lib
    from fbos_jax.engine import is_params_source
    sp = self.parts.sampling
    version = -1
    if is_params_source(params):
      if sp.engine != "continuous":
        params, version = params.current()
    else:
      state_lib.check_compute_params(params, self.model_cfg, "RolloutContext.sample")
    if sp.engine == "continuous":
      from fbos_jax import engine
      out = engine.sample(params, self.model_cfg, contexts, key=key, n_per_prompt=n,
                          config=sampling, engine_config=sp.engine_config, mesh=self.mesh,
                          rules=self.rules, allow_empty=True, stats=self.engine_stats,
                          stream_ids=stream_ids)
    else:
      out = sampling_lib.sample(params, self.model_cfg, contexts, key=key, n_per_prompt=n,
                                config=sampling, mesh=self.mesh, rules=self.rules,
                                allow_empty=True, stream_ids=stream_ids)
    texts = self.decode(out.tokens, out.lengths) if out.tokens.shape[0] else []
    mask = np.asarray(out.response_mask, np.int32)
    versions = out.versions if out.versions is not None else np.full(mask.shape, version)
    return Samples(np.asarray(out.tokens, np.int32), mask, np.asarray(out.logprobs, np.float32),
                   np.asarray(out.lengths, np.int32), texts,
                   np.where(mask > 0, versions, -1).astype(np.int64))

  def close(self):
    close = getattr(self.pool, "close", None)
    if close:
      close()
