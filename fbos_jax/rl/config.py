"""From a config (``configs/*.py``, an ml_collections ConfigDict) to the run's typed parts.

:func:`validate` rejects meaningless values and combinations before anything
is built, naming every offending field. :func:`build_parts` then turns the
config into the frozen (hashable) dataclasses the library takes, once per run:

* ``model``: :class:`fbos_jax.model.qwen.ModelConfig`;
* ``sampling``: one :class:`fbos_jax.sampling.SamplingConfig` per kind of
  sampler call (``round1``, ``round2``, ``eval``, ``eval_sampled``);
* ``rollout``: :class:`RolloutSpec`, what the rollout phases do;
* ``update``: :class:`UpdateConfig`, the terms of the objective and the loop shape;
* ``optim``: :class:`OptimConfig`;
* ``asynchronous``: :class:`AsyncConfig`, the rollout / trainer split and the
  staleness bound (``fbos_jax/rl/sources.py``).

Nothing below this module reads ``config.sampling`` or ``config.rl``: the
parts are handed down (:class:`fbos_jax.rl.context.RolloutContext` holds them).
A field of ``sampling`` or ``rl`` that no part consumes is refused here, named
(a typo in a config file would otherwise be ignored).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import fbos_kernels as K

from fbos_jax.rl import batch_kinds


@dataclasses.dataclass(frozen=True)
class Term:
  """One named term of the objective: the rows of ``batch`` under ``loss``, times ``weight``."""
  batch: str
  loss: str  # a name of fbos_kernels.POLICY_LOSSES
  weight: float


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The static knobs of every term's token loss (part of the compiled program)."""
  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
  loss_agg: str = "token-mean"
  norm_len: int = 0  # seq-mean-token-sum-norm's constant; 0 = the response bucket length
  eps_low: float = 0.2
  eps_high: float = 0.28  # clip-higher (DAPO)
  dual_clip: float = 0.0  # 0 = off; else c > 1 (e.g. 3.0), applied where A < 0
  offpolicy_lambda: float = 0.1  # f(u) = u / (u + lambda)
  offpolicy_ratio_denominator: str = "one"  # one | behaviour
  behav_weight_cap: float = 5.0  # AReaL: mask tokens whose pi_prox/pi_behav exceeds this
  kl_beta: float = 0.0  # > 0 keeps a frozen reference model in the train state
  kl_kind: str = "k3"
  entropy_coef: float = 0.0
  temperature: float = 1.0  # log-probs are of the temperature-scaled policy
  time_chunk: int = 256
  vocab_chunk: int = 8192
  vocab_limit: int = 0  # > 0: ids >= this (beyond the tokenizer) are never drawn; the
  #                       log-probs and entropy are over the first vocab_limit ids, as sampled


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
  """What one update step does: the terms, their loss knobs, and the loop shape
  (epochs x mini-batches x micro-batches).

  ``micro_batch_tokens`` > 0 packs every batch (``fbos_jax/rl/packing.py``): its
  sequences end to end in rows of its padded row length, micro-batches of this
  many tokens on each batch shard, as many as the real tokens need (a bucket);
  ``micro_batches`` is then 1. With ``fixed_micro_batches`` (``rl.fixed_row_buckets``)
  a packed batch always has the most micro-batches its rows can fill (one update
  program per prompt bucket) and the update skips the empty ones (``lax.cond``),
  so it computes as many as the real tokens need."""
  terms: tuple  # of Term, weight > 0
  loss: LossConfig = LossConfig()
  epochs: int = 1  # rl.ppo_epochs
  mini_batches: int = 1  # optimizer steps per rollout batch per epoch
  micro_batches: int = 1  # gradient accumulation inside one optimizer step (exact token-mean)
  schedule: str = "joint"  # rl.objective_schedule: joint | alternate (terms take turns by step)
  skip_nonfinite: bool = True  # skip (and log) a step whose loss/grad is not finite; False = fatal
  micro_batch_tokens: int = 0  # > 0: packed batches, micro-batches by this token budget
  fixed_micro_batches: bool = False  # packed: the most micro-batches, empty ones skipped

  @property
  def packed(self) -> bool:
    """Whether the update trains on packed batches (real tokens)."""
    return self.micro_batch_tokens > 0

  @property
  def needs_prox(self) -> bool:
    """Whether a term needs pi_prox log-probs (the decoupled objective)."""
    return any(t.loss == "decoupled" for t in self.terms)

  @property
  def batch_names(self) -> tuple:
    return tuple(t.batch for t in self.terms)

  @property
  def row_multiple(self) -> int:
    """Rows of every batch divide by this (x the batch shards): the update splits them."""
    return self.mini_batches * self.micro_batches


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with warm-up and a schedule (``fbos_jax/optim.py``); ``total_steps``
  optimizer steps in the run (the schedule's length)."""
  learning_rate: float
  schedule: str = "constant"  # constant | cosine
  warmup_steps: int = 10
  b1: float = 0.9
  b2: float = 0.999
  weight_decay: float = 0.01
  grad_clip: float = 1.0  # the global gradient norm is clipped to this; 0 = off
  opt_state_dtype: str = "float32"  # Adam's moments, whatever the params' dtype
  total_steps: int = 1
  # True: update k at the schedule's value at k, so a warmed-up run's update 0 is at
  # lr 0 (optax's count). Only the SFT warm start keeps it: its result is sensitive to
  # the exact schedule (issue 33: with the first update trained, tiny_chain's warm start
  # landed at greedy 0.16 instead of 0.41), and docs/results rest on that warm start.
  # RL never does (a whole step's rollouts would train nothing): fbos_jax/optim.py.
  warmup_from_zero: bool = False


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
  """What one step's rollout does (``fbos_jax/rl/rollout.py``), with the
  largest shapes it can produce (``fbos_jax/rl/shapes.py``).

  prompts_per_step P, group_size n (round-1 rollouts per prompt), round2_size m.
  """
  prompts_per_step: int
  group_size: int
  prompt: str = "plain"  # plain: sample on q | fcp: on <EF>c+</EF>q (FCP, section 7)
  fcp_positive_feedback: str = "correct"  # c+ of rl.prompt=fcp
  # --- feedback-guided exploration (round 2); off for GRPO/GFPO
  round2: bool = False
  round2_size: int = 8  # m: round-2 rollouts per prompt
  fap_from: str = "failed"  # failed | all: which round-1 rollouts get a FAP
  fap_mode: str = "single"  # single: FAP(q, o_i, F_i) | aggregated: GOLF's one prompt per q
  # --- EPA: feedback-guided rollouts pulled back onto q as off-policy samples
  epa_select: str = "correct"  # correct | improved | all
  epa_mode: str = "append"  # append (group grows) | replace (GOLF)
  epa_trigger: str = "always"  # always | adaptive (only when round-1 mean reward < epa_tau)
  epa_tau: float = -1.0  # -1 = 1/n
  epa_max_per_prompt: int = 8  # cap on appended/replaced samples per prompt (static shapes)
  ecc_advantage: str = "group"  # group | improvement (ECC's advantage on the FAPs)
  advantage: str = "grpo"  # grpo | drgrpo | batch_std (section 1)
  adv_eps: float = 1e-6
  # --- GFPO
  gfpo_k: int = 0  # 0 = off; keep k of G per group
  gfpo_metric: str = "length"  # length | token_efficiency
  gfpo_adaptive: bool = False  # adaptive-difficulty k (k_map over difficulty buckets)
  gfpo_k_map: tuple = (8, 8, 6, 4)  # very hard, hard, medium, easy (for G=16)
  gfpo_history: int = 256
  fixed_row_buckets: bool = False  # True: one update program per run (pad rows to the max)
  # a prompt's round 2 joins the engine's queue as soon as its round-1 verdicts are in
  # (decoding beside the rest of round 1; fbos_jax/rl/stream.py); needs
  # sampling.engine=continuous. The step's rollouts are the same either way.
  stream_rounds: bool = False
  success_threshold: float = 1.0
  terms: tuple = ()  # the update's terms (which batches the rollout builds)

  @property
  def gfpo(self) -> bool:
    return bool(self.gfpo_k or self.gfpo_adaptive)

  @property
  def conditional(self) -> bool:
    """Whether round 1 and the eval sample under <EF>c+</EF>q (``rl.prompt=fcp``:
    the prompt mode of FCP, not its batch)."""
    return self.prompt == "fcp"

  @property
  def tau(self) -> float:
    return self.epa_tau if self.epa_tau >= 0 else 1.0 / self.group_size

  @property
  def batch_names(self) -> tuple:
    return tuple(t.batch for t in self.terms)

  @property
  def epa_extra(self) -> int:
    """Rows appended per EPA group (feedback-guided rollouts pulled back onto q)."""
    return self.epa_max_per_prompt if (self.round2 and self.epa_mode == "append") else 0


ENGINES = ("static", "continuous", "auto")


def resolve_engine(engine: str, ahead: bool) -> str:
  """The sampler a run uses for ``sampling.engine``: ``auto`` is the continuous
  engine when the rollout may sample ahead of the trainer (``ahead``:
  ``rl.max_staleness > 0``; its rollout streams the steps through one engine
  run, so generation never drains between batches, ``fbos_jax/rl/sources.py``)
  and the static sampler otherwise, so that eta = 0 (split or not) keeps the
  synchronous run's params bit for bit (the engine's rows equal the static
  sampler's only up to near-tie flips); static and continuous are themselves."""
  engine = str(engine)
  if engine not in ENGINES:
    raise ValueError(f"sampling.engine={engine!r}: expected one of {' | '.join(ENGINES)}")
  if engine == "auto":
    return "continuous" if ahead else "static"
  return engine


def _ahead(rl) -> bool:
  """Whether ``rl`` lets the rollout sample ahead (eta > 0; a bad value: no, refused
  by name in validation)."""
  try:
    return int(rl.max_staleness) > 0
  except (TypeError, ValueError):
    return False
INFLIGHT_UPDATES = ("keep_kv", "recompute")


@dataclasses.dataclass(frozen=True)
class AsyncConfig:
  """AReaL's system (``fbos_jax/rl/sources.py``): a rollout worker and the trainer
  overlap, with bounded staleness.

  rollout_devices: N devices form the rollout mesh, the rest the trainer mesh
    (0: one mesh, colocated). max_staleness: eta; batch k of B groups is admitted
    while floor((N_r - 1) / B) <= i + eta (N_r = (k + 1) B groups requested, i the
    trainer's version); 0 with rollout_devices 0 is the synchronous loop.
  buffer_groups: finished groups the buffer holds (0: (eta + 1) x B).
  inflight_update: how a weight update reaches rows in flight (the continuous
    engine, between decode windows): keep_kv (PipelineRL: the cache the old
    weights wrote stays) | recompute (AReaL: the rows' cache is recomputed).
  sync_chunk_bytes: the weight sync copies at most this many bytes of params at once.
  rollout_mesh: ((axis, size), ...) the rollout mesh's axes over ``mesh.*`` when
    split (``rl.rollout_mesh``; only the non-zero ones).
  sync_timeout_s: a transfer between the processes of a split (weights, a batch)
    that takes longer fails, naming its side and version.
  """
  rollout_devices: int = 0
  max_staleness: int = 0
  buffer_groups: int = 0
  inflight_update: str = "keep_kv"
  sync_chunk_bytes: int = 512 * 2 ** 20
  rollout_mesh: tuple = ()
  sync_timeout_s: float = 600.0

  @property
  def enabled(self) -> bool:
    """Whether the asynchronous loop runs (a split, or eta > 0)."""
    return self.rollout_devices > 0 or self.max_staleness > 0

  def buffer_batches(self, prompts_per_step: int) -> int:
    """Step batches (of ``prompts_per_step`` groups) the buffer holds."""
    groups = self.buffer_groups or (self.max_staleness + 1) * prompts_per_step
    return max(groups // max(prompts_per_step, 1), 1)


@dataclasses.dataclass(frozen=True)
class SamplingParts:
  """The sampler settings of each kind of call (``fbos_jax.sampling.SamplingConfig``):
  ``round1`` (the prompts q, or FCP's), ``round2`` (FAPs / aggregated prompts:
  ``sampling.fap_prompt_buckets``), ``eval`` (``sampling.eval_temperature``,
  greedy by default) and ``eval_sampled`` (pass@k, temperature 1); and which
  sampler runs them (``engine``: static | continuous, with ``engine_config``,
  ``fbos_jax.engine.EngineConfig``)."""
  round1: object
  round2: object
  eval: object
  eval_sampled: object
  engine: str = "static"
  engine_config: object = None


@dataclasses.dataclass(frozen=True)
class RunParts:
  """The run's typed parts, built once by :func:`build_parts` and handed down."""
  model: object  # fbos_jax.model.qwen.ModelConfig
  sampling: SamplingParts
  rollout: RolloutSpec
  update: UpdateConfig
  optim: OptimConfig
  seed: int = 0
  asynchronous: AsyncConfig = AsyncConfig()


# ----------------------------------------------------------------------------- defaults
#
# The typed parts' dataclasses are the one home of the library's defaults: the
# sections of ``configs/base.py`` that they own (``rl``, ``optim``, ``sampling``'s
# sampler fields, ``model``'s attention fields) are built from them
# (:func:`section_defaults`), and ``configs/base.py`` sets over them only what
# the project's configs change, each change a commented line of its
# ``CHANGED_DEFAULTS`` (``tests/test_config_defaults.py`` fails on any other
# difference).

# A part's field under another name (or unit) in the config: {part field: rl field}.
# build_parts reads rl.<the config's name>; the defaults come out under it.
RL_NAMES = {"epochs": "ppo_epochs", "schedule": "objective_schedule",
            "fixed_micro_batches": "fixed_row_buckets",
            "sync_chunk_bytes": "sync_chunk_mib"}  # MiB in the config, bytes in AsyncConfig
MIB = 2 ** 20
# The fields of the typed parts that are not config fields: set by build_parts from
# elsewhere (the tokenizer, sampling.temperature, verifier.success_threshold,
# train.steps, rl.terms) or library knobs no config sets.
NOT_CONFIG_FIELDS = {
    "LossConfig": ("norm_len", "temperature", "time_chunk", "vocab_chunk", "vocab_limit"),
    "UpdateConfig": ("terms", "loss"),
    "RolloutSpec": ("success_threshold", "terms"),
    "OptimConfig": ("total_steps", "warmup_from_zero"),
    "SamplingConfig": ("greedy", "truncate", "pad_id", "layer_loop", "cache_dtype",
                       "decode_phases", "vocab_limit"),
}


def defaults_of(cls, renames: Optional[dict] = None, *, only=None) -> dict:
  """{config field: default} of dataclass ``cls``'s fields that have a default
  and are config fields (not in :data:`NOT_CONFIG_FIELDS`; ``only``: just these),
  named as the config names them (``renames``: {part field: config field})."""
  renames, skip = renames or {}, NOT_CONFIG_FIELDS.get(cls.__name__, ())
  out = {}
  for f in dataclasses.fields(cls):
    if f.name in skip or (only is not None and f.name not in only):
      continue
    if f.default is not dataclasses.MISSING:
      out[renames.get(f.name, f.name)] = f.default
    elif f.default_factory is not dataclasses.MISSING:
      out[renames.get(f.name, f.name)] = f.default_factory()
  return out


def _merged(*dicts) -> dict:
  """One section from several parts' defaults; a field two parts share must agree."""
  out = {}
  for d in dicts:
    for k, v in d.items():
      if k in out and out[k] != v:
        raise ValueError(f"two typed parts disagree on the default of {k}: {out[k]!r} vs {v!r}")
      out[k] = v
  return out


def section_defaults(section: str) -> dict:
  """The library's defaults of config section ``section``, in the config's names
  and units: ``rl`` (:class:`RolloutSpec`, :class:`LossConfig`,
  :class:`UpdateConfig`, :class:`AsyncConfig`; ``rl.terms`` from the batch kinds,
  every weight 0), ``optim`` (:class:`OptimConfig`; ``learning_rate`` has no
  default), ``sampling`` (the sampler's fields of
  :class:`fbos_jax.sampling.SamplingConfig`) and ``model`` (the attention fields
  of :class:`fbos_jax.model.qwen.ModelConfig`: the architecture is a variant's)."""
  if section == "rl":
    from fbos_jax import sharding as sh
    asy = defaults_of(AsyncConfig, RL_NAMES)
    asy["sync_chunk_mib"] //= MIB
    asy["rollout_mesh"] = {axis: dict(asy["rollout_mesh"]).get(axis, 0) for axis in sh.MESH_AXES}
    terms = {k.name: {"loss": k.loss, "weight": 0.0} for k in batch_kinds.KINDS.values()}
    return _merged(defaults_of(RolloutSpec, RL_NAMES), defaults_of(LossConfig, RL_NAMES),
                   defaults_of(UpdateConfig, RL_NAMES), asy, {"terms": terms})
  if section == "optim":
    return defaults_of(OptimConfig)
  if section == "sampling":
    from fbos_jax import sampling as sampling_lib
    return defaults_of(sampling_lib.SamplingConfig)
  if section == "model":
    from fbos_jax.model import qwen
    return defaults_of(qwen.ModelConfig,
                       only=("attention", "attention_block_q", "attention_block_kv"))
  raise ValueError(f"no typed part owns config section {section!r}")


class _Reads:
  """A config section that records which fields were read (unread ones are unknown)."""

  def __init__(self, section, name: str):
    self._section, self._name, self.read = section, name, set()

  def __getattr__(self, field):
    if field.startswith("_") or field == "read":
      raise AttributeError(field)
    self.read.add(field)
    return self._section[field]

  def unknown(self, also_known=()) -> list:
    return sorted(set(self._section.keys()) - self.read - set(also_known))


def terms_of(config) -> tuple:
  """The active terms (weight > 0) of ``config.rl.terms``, in a fixed order."""
  out = []
  for name in batch_kinds.NAMES:
    t = config.rl.terms.get(name)
    if t is not None and float(t.weight) > 0:
      out.append(Term(name, str(t.loss), float(t.weight)))
  return tuple(out)


def _loss_config(rl, sampling, vocab_limit: int) -> LossConfig:
  return LossConfig(
      loss_agg=rl.loss_agg, eps_low=float(rl.eps_low), eps_high=float(rl.eps_high),
      dual_clip=float(rl.dual_clip), offpolicy_lambda=float(rl.offpolicy_lambda),
      offpolicy_ratio_denominator=rl.offpolicy_ratio_denominator,
      behav_weight_cap=float(rl.behav_weight_cap), kl_beta=float(rl.kl_beta),
      kl_kind=rl.kl_kind, entropy_coef=float(rl.entropy_coef),
      temperature=float(sampling.temperature) or 1.0, vocab_limit=int(vocab_limit))


def _update_config(config, rl, sampling, vocab_limit: int) -> UpdateConfig:
  return UpdateConfig(terms=terms_of(config), loss=_loss_config(rl, sampling, vocab_limit),
                      epochs=max(int(rl.ppo_epochs), 1), mini_batches=max(int(rl.mini_batches), 1),
                      micro_batches=max(int(rl.micro_batches), 1),
                      schedule=rl.objective_schedule, skip_nonfinite=bool(rl.skip_nonfinite),
                      micro_batch_tokens=int(rl.micro_batch_tokens),
                      fixed_micro_batches=bool(rl.fixed_row_buckets))


def optim_config(section, total_steps: int, **overrides) -> OptimConfig:
  """``config.optim`` (or an SFT variant of it: ``overrides``) as an :class:`OptimConfig`."""
  fields = {f.name for f in dataclasses.fields(OptimConfig)} - {"total_steps"}
  kw = {k: section[k] for k in fields if k in section}
  kw.update(overrides)
  return OptimConfig(total_steps=int(total_steps), **kw)


def _rollout_spec(config, rl, terms) -> RolloutSpec:
  names = [f.name for f in dataclasses.fields(RolloutSpec)
           if f.name not in ("success_threshold", "terms")]
  kw = {k: getattr(rl, k) for k in names}
  kw["gfpo_k_map"] = tuple(int(k) for k in kw["gfpo_k_map"])
  return RolloutSpec(success_threshold=float(config.verifier.success_threshold), terms=terms, **kw)


def _async_config(rl) -> AsyncConfig:
  return AsyncConfig(rollout_devices=int(rl.rollout_devices),
                     max_staleness=int(rl.max_staleness), buffer_groups=int(rl.buffer_groups),
                     inflight_update=str(rl.inflight_update),
                     sync_chunk_bytes=int(float(rl.sync_chunk_mib) * 2 ** 20),
                     rollout_mesh=_rollout_mesh(rl.rollout_mesh),
                     sync_timeout_s=float(rl.sync_timeout_s))


def _rollout_mesh(section) -> tuple:
  """``rl.rollout_mesh`` as ((axis, size), ...), the non-zero axes; a field that is
  not a mesh axis, or a size that is not -1, 0 or positive, is refused by name."""
  from fbos_jax import sharding as sh
  out = []
  for axis, size in sorted(dict(section or {}).items()):
    if axis not in sh.MESH_AXES:
      raise ValueError(f"rl.rollout_mesh.{axis}: not a mesh axis ({', '.join(sh.MESH_AXES)})")
    if isinstance(size, bool) or not isinstance(size, int) or size < -1:
      raise ValueError(f"rl.rollout_mesh.{axis}={size!r}: an axis size, -1 (the rest) or 0 "
                       "(as mesh.*)")
    if size:
      out.append((axis, int(size)))
  return tuple(out)


def async_config(config) -> AsyncConfig:
  """``config``'s :class:`AsyncConfig` alone (``fbos_jax/rl/run.py`` picks the loop by it)."""
  return _async_config(config.rl)


def _engine_config(section):
  """``config.engine`` as an :class:`fbos_jax.engine.EngineConfig` (validated)."""
  from fbos_jax.engine import EngineConfig
  names = {f.name for f in dataclasses.fields(EngineConfig)}
  given = section.to_dict() if hasattr(section, "to_dict") else dict(section)
  unknown = sorted(set(given) - names)
  if unknown:
    raise ValueError(f"unknown config field(s) {', '.join('engine.' + k for k in unknown)}: "
                     "nothing reads them (a typo?); see fbos_jax/engine/types.py:EngineConfig")
  kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in given.items()}
  try:
    return EngineConfig(**kw).validate()
  except ValueError as e:
    raise ValueError(str(e)) from None


def _sampling_parts(sampling, *, pad_id: int, stop_ids: tuple, vocab_limit: int,
                    engine_section=None, ahead: bool = False) -> SamplingParts:
  from fbos_jax import sampling as sampling_lib
  batch = tuple(int(b) for b in sampling.batch_buckets) or sampling_lib.DEFAULT_BATCH_BUCKETS
  round1 = sampling_lib.SamplingConfig(
      max_new_tokens=int(sampling.max_new_tokens), temperature=float(sampling.temperature),
      top_k=int(sampling.top_k), top_p=float(sampling.top_p),
      stop_token_ids=tuple(dict.fromkeys(int(s) for s in stop_ids)),
      prompt_buckets=tuple(int(b) for b in sampling.prompt_buckets), batch_buckets=batch,
      pad_id=int(pad_id), vocab_limit=int(vocab_limit))
  r = dataclasses.replace
  engine = resolve_engine(sampling.engine, ahead)
  return SamplingParts(
      round1=round1,
      round2=r(round1, prompt_buckets=tuple(int(b) for b in sampling.fap_prompt_buckets)),
      eval=r(round1, temperature=float(sampling.eval_temperature)),
      eval_sampled=r(round1, temperature=1.0), engine=engine,
      engine_config=_engine_config(engine_section) if engine_section is not None else None)


def build_parts(config, *, pad_id: int = 0, eos_id: Optional[int] = None,
                vocab_limit: int = 0) -> RunParts:
  """The run's typed parts from ``config``, once.

  pad_id, eos_id: the tokenizer's (the stop ids are EOS + ``sampling.stop_token_ids``);
  vocab_limit: the tokenizer's size (0 = the model's whole vocabulary), so that
  ids beyond the tokenizer are never drawn and log-probs are over the same ids.
  Raises ValueError naming any ``sampling.*`` / ``rl.*`` field no part consumes."""
  from fbos_jax.model import qwen
  rl, sampling = _Reads(config.rl, "rl"), _Reads(config.sampling, "sampling")
  model = qwen.ModelConfig.from_dict(config.model)
  limit = int(vocab_limit) if vocab_limit and int(vocab_limit) < model.vocab_size else 0
  stop_ids = ((int(eos_id),) if eos_id is not None else ()) + tuple(
      int(s) for s in sampling.stop_token_ids)
  update = _update_config(config, rl, sampling, limit)
  parts = RunParts(
      model=model,
      sampling=_sampling_parts(sampling, pad_id=pad_id, stop_ids=stop_ids, vocab_limit=limit,
                               engine_section=config.get("engine"),
                               ahead=_ahead(config.rl)),
      rollout=_rollout_spec(config, rl, update.terms),
      update=update,
      optim=optim_config(config.optim, int(config.train.steps) * update.epochs
                         * update.mini_batches),
      seed=int(config.seed), asynchronous=_async_config(rl))
  bad = ([f"sampling.{k}" for k in sampling.unknown()]
         + [f"rl.{k}" for k in rl.unknown(also_known=("terms",))])
  if bad:
    raise ValueError(f"unknown config field(s) {', '.join(bad)}: nothing reads them (a typo?); "
                     "the fields are in configs/base.py, their defaults in the typed parts it is "
                     "built from (fbos_jax/rl/config.py)")
  return parts


def with_checkpoint_model(config, init_from_hf: str = ""):
  """The run's config with the architecture (and stop ids) of the HF checkpoint
  ``init_from_hf`` or ``model.hf_path``: the file wins over a preset, so a model
  is never built with another checkpoint's rope_theta or norm eps, and every
  entry point (train, eval, export) stops where the checkpoint's generation
  config says (Qwen3: ``<|im_end|>`` and ``<|endoftext|>``)."""
  from fbos_jax.model import hf
  src = init_from_hf or config.model.hf_path
  if not src:
    return config
  config = hf.apply_hf_config(config, src)
  if not tuple(config.sampling.stop_token_ids):
    with config.unlocked():
      config.sampling.stop_token_ids = tuple(hf.generation_stop_ids(src))
  return config


# ----------------------------------------------------------------------------- validation


def _choice(errs, field, value, options):
  if value not in options:
    errs.append(f"{field}={value!r}: expected one of {' | '.join(options)}")


def _positive(errs, field, value, *, allow_zero=False):
  ok = isinstance(value, (int, float)) and math.isfinite(value) and (
      value >= 0 if allow_zero else value > 0)
  if not ok:
    errs.append(f"{field}={value!r}: must be {'>= 0' if allow_zero else '> 0'}")


def validate(config, num_batch_shards: int = 1, process_count: Optional[int] = None,
             overrides=()):
  """Raise ValueError listing every meaningless value or combination, by field.

  overrides: the dotted fields set on top of the config file (``launch/train.py``'s
  ``--config.*`` flags): one that the run would ignore is refused too
  (:func:`stage_override_errors`)."""
  if process_count is None:
    import jax
    process_count = jax.process_count()
  errs: list[str] = stage_override_errors(config, overrides)
  _validate_rl(config, errs)
  _validate_rest(config, errs)
  rl = config.rl
  if rl.prompts_per_step % max(rl.mini_batches, 1):
    errs.append(f"rl.prompts_per_step={rl.prompts_per_step} is not divisible by "
                f"rl.mini_batches={rl.mini_batches}")
  if (rl.prompts_per_step * rl.group_size) % num_batch_shards:
    errs.append(f"rl.prompts_per_step*rl.group_size={rl.prompts_per_step * rl.group_size} "
                f"rollouts do not divide over the mesh's {num_batch_shards} batch shards "
                "(mesh.dcn*data*fsdp); change one of them")
  if rl.prompts_per_step % process_count:
    errs.append(f"rl.prompts_per_step={rl.prompts_per_step} does not divide over "
                f"{process_count} processes (each host samples its own prompts)")
  if errs:
    raise ValueError("Invalid config:\n  - " + "\n  - ".join(errs))


def _validate_rl(config, errs):
  rl = config.rl
  terms = terms_of(config)
  if not terms and config.train.steps > 0:
    errs.append("rl.terms: every term has weight 0, so RL would train nothing; set e.g. "
                "--config.rl.terms.epa.weight=1")
  for name, t in rl.terms.items():
    if name not in batch_kinds.NAMES:
      errs.append(f"rl.terms.{name}: unknown term; the rollout builds "
                  f"{' | '.join(batch_kinds.NAMES)}")
    if t.loss not in K.POLICY_LOSSES:
      errs.append(f"rl.terms.{name}.loss={t.loss!r}: expected one of "
                  f"{' | '.join(sorted(K.POLICY_LOSSES))}")
    if not (isinstance(t.weight, (int, float)) and math.isfinite(t.weight) and t.weight >= 0):
      errs.append(f"rl.terms.{name}.weight={t.weight!r}: must be >= 0 (0 = off)")
  names = {t.batch for t in terms}
  pg = any(t.loss in K.ADVANTAGE_LOSSES for t in terms)
  if pg and rl.group_size < 2:
    errs.append(f"rl.group_size={rl.group_size}: group-normalised advantages need >= 2 "
                "rollouts per prompt (set --config.rl.group_size=8)")
  if rl.group_size < 1:
    errs.append(f"rl.group_size={rl.group_size}: must be >= 1")
  if rl.gfpo_k and not rl.gfpo_adaptive and not 0 < rl.gfpo_k < rl.group_size:
    errs.append(f"rl.gfpo_k={rl.gfpo_k} must be in [1, group_size-1={rl.group_size - 1}] "
                "(GFPO keeps k of G)")
  if rl.round2 and config.data.verifier in ("", "none"):
    errs.append(f"rl.round2=True (fap_mode={rl.fap_mode!r}) needs verifier feedback, but "
                f"data.verifier={config.data.verifier!r}")
  for name in sorted(names):
    if batch_kinds.kind(name).needs_round2 and not rl.round2:
      errs.append(f"rl.terms.{name}.weight={rl.terms[name].weight} > 0 trains on round-2 "
                  "rollouts (on their FAPs), which needs rl.round2=True")
  users = [k.name for k in batch_kinds.KINDS.values() if k.uses_round2]
  if rl.round2 and not names & set(users):
    errs.append(f"rl.round2=True samples feedback-guided rollouts, but none of "
                f"{', '.join('rl.terms.' + n for n in users)} uses them (their weights are 0)")
  _validate_rl_values(config, errs)


# the rl fields that take one of a few names; the kernels' own are read from their
# registries (the terms' losses: fbos_kernels.POLICY_LOSSES)
RL_CHOICES = {
    "prompt": ("plain", "fcp"), "advantage": tuple(K.ADVANTAGE_ESTIMATORS),
    "loss_agg": tuple(K.AGGREGATION_MODES), "offpolicy_ratio_denominator": K.RATIO_DENOMINATORS,
    "objective_schedule": ("joint", "alternate"), "fap_from": ("failed", "all"),
    "fap_mode": ("single", "aggregated"), "epa_select": ("correct", "improved", "all"),
    "epa_mode": ("append", "replace"), "epa_trigger": ("always", "adaptive"),
    "ecc_advantage": ("group", "improvement"), "gfpo_metric": tuple(K.GFPO_METRICS),
    "kl_kind": K.KL_ESTIMATORS, "inflight_update": INFLIGHT_UPDATES,
}


def choice_fields() -> dict:
  """Every field of ``sampling``, ``engine`` and ``rl`` that takes one of a few
  names, dotted -> the names (what validation accepts; ``tests`` enumerate them)."""
  from fbos_jax.engine import types as engine_types
  out = {"sampling.engine": ENGINES, "engine.attention": engine_types.ATTENTION}
  out.update({f"rl.{k}": v for k, v in RL_CHOICES.items()})
  out.update({f"rl.terms.{t}.loss": tuple(sorted(K.POLICY_LOSSES)) for t in batch_kinds.NAMES})
  return out


def _validate_rl_values(config, errs):
  """Choices and ranges of the rl section, one field at a time."""
  rl = config.rl
  terms = terms_of(config)
  for f, options in RL_CHOICES.items():
    _choice(errs, f"rl.{f}", rl[f], options)
  if rl.round2 and config.templates.max_prompt_tokens > max(config.sampling.fap_prompt_buckets):
    errs.append(f"templates.max_prompt_tokens={config.templates.max_prompt_tokens} exceeds the "
                f"largest sampling.fap_prompt_buckets={max(config.sampling.fap_prompt_buckets)}")
  for f in ("epa_max_per_prompt", "kl_beta", "entropy_coef"):
    _positive(errs, f"rl.{f}", rl[f], allow_zero=True)
  for f in ("ppo_epochs", "mini_batches", "micro_batches", "prompts_per_step", "round2_size",
            "offpolicy_lambda", "adv_eps", "behav_weight_cap"):
    _positive(errs, f"rl.{f}", rl[f])
  if not 0 <= rl.eps_low < 1 or not rl.eps_high >= 0:
    errs.append(f"rl.eps_low={rl.eps_low}, rl.eps_high={rl.eps_high}: need 0 <= eps_low < 1 "
                "and eps_high >= 0")
  if rl.dual_clip and not rl.dual_clip > 1:
    errs.append(f"rl.dual_clip={rl.dual_clip}: must be > 1 (e.g. 3.0), or 0 = off")
  engine = config.sampling.engine
  used = resolve_engine(engine, _ahead(rl)) if engine in ENGINES else engine
  if rl.stream_rounds and used != "continuous":
    auto = " (sampling.engine='auto' at rl.max_staleness=0)" if engine == "auto" else ""
    errs.append(f"rl.stream_rounds=True streams round 2 into the continuous engine's queue, "
                f"but sampling.engine={used!r}{auto}; set --config.sampling.engine=continuous")
  if rl.stream_rounds and not rl.round2:
    errs.append("rl.stream_rounds=True streams round 2 beside round 1, but rl.round2=False "
                "(this algorithm has no round 2), so it would change nothing; drop it")
  _validate_async(rl, errs)
  _validate_packing(config, errs)


def longest_row(config) -> tuple:
  """(tokens, what) of the longest row any batch of the update can have: the
  largest prompt bucket a term (or the SFT warm start) trains on plus
  ``sampling.max_new_tokens``."""
  s = config.sampling
  fields = [batch_kinds.kind(t.batch).prompt_field for t in terms_of(config)]
  if config.train.warm_start == "sft":  # demonstrations and corrections: both kinds of bucket
    fields = ["sampling.prompt_buckets", "sampling.fap_prompt_buckets"]
  fields = fields or ["sampling.prompt_buckets"]
  best = max((max(int(b) for b in s[f.split(".")[1]]), f) for f in dict.fromkeys(fields))
  r = int(s.max_new_tokens)
  return best[0] + r, f"{best[1]} up to {best[0]} + sampling.max_new_tokens={r}"


def _validate_packing(config, errs):
  """``rl.micro_batch_tokens``: 0 (padded rows), or a budget that holds the longest
  row whole (a sequence is never cut), with the micro-batch count its own."""
  rl = config.rl
  budget = rl.micro_batch_tokens
  if not (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0):
    errs.append(f"rl.micro_batch_tokens={budget!r}: an integer >= 0 (0 = padded rows)")
    return
  if not budget:
    return
  if not isinstance(config.sampling.max_new_tokens, int):
    return  # refused on its own
  longest, what = longest_row(config)
  if budget < longest:
    errs.append(f"rl.micro_batch_tokens={budget} is shorter than the longest row the config "
                f"can produce, {longest} tokens ({what}); a row is never cut: raise it to "
                f">= {longest}")
  if rl.micro_batches != 1:
    errs.append(f"rl.micro_batches={rl.micro_batches} with rl.micro_batch_tokens={budget}: "
                "packed batches take as many micro-batches of the token budget as their real "
                "tokens need; set rl.micro_batches=1")
  if rl.fixed_row_buckets and rl.mini_batches > 1:
    errs.append(f"rl.fixed_row_buckets=True with rl.micro_batch_tokens={budget} and "
                f"rl.mini_batches={rl.mini_batches}: the fixed packed layout skips its empty "
                "micro-batches, which a mini-batch shuffle would scatter; set rl.mini_batches=1 "
                "or rl.fixed_row_buckets=False (a micro-batch count per bucket)")


def _validate_async(rl, errs):
  """The asynchronous loop's fields (the device split itself is checked where the
  devices are known: ``fbos_jax/rl/split.py``)."""
  for f in ("rollout_devices", "max_staleness", "buffer_groups"):
    v = rl[f]
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
      errs.append(f"rl.{f}={v!r}: must be an integer >= 0")
  _positive(errs, "rl.sync_chunk_mib", rl.sync_chunk_mib)
  _positive(errs, "rl.sync_timeout_s", rl.sync_timeout_s)
  b = rl.prompts_per_step
  if isinstance(rl.buffer_groups, int) and 0 < rl.buffer_groups < b:
    errs.append(f"rl.buffer_groups={rl.buffer_groups} is smaller than one batch: the trainer "
                f"takes rl.prompts_per_step={b} groups per step (0 = (max_staleness + 1) x {b})")


def _validate_master(config, errs):
  """A master (``model.param_dtype``) of fewer significant bits than float32 loses
  the updates: refused unless ``optim.allow_low_precision_params``."""
  import numpy as np
  import jax.numpy as jnp
  try:
    dt = jnp.dtype(config.model.param_dtype)
  except TypeError:
    errs.append(f"model.param_dtype={config.model.param_dtype!r}: not a dtype")
    return
  trains = config.train.steps > 0 or config.train.warm_start == "sft"
  if (not jnp.issubdtype(dt, jnp.floating) or not trains
      or config.optim.get("allow_low_precision_params", False)):
    return
  bits = int(jnp.finfo(dt).nmant) + 1  # significant bits, the implicit one included
  if bits >= np.finfo(np.float32).nmant + 1:
    return
  lr = config.optim.learning_rate
  errs.append(
      f"model.param_dtype={dt.name}: the trained master would keep {bits} significant bits, "
      f"so an Adam step of about optim.learning_rate={lr:g} rounds away on every weight "
      f"larger than ~2^{bits} x lr = {lr * 2 ** bits:.3g} in magnitude (at lr 1e-6, about 98% "
      f"of N(0, 0.02) weights; update/param_change_frac counts what a step changed). Keep a "
      f"float32 master (--config.model.param_dtype=float32; the forward pass runs in "
      f"model.compute_dtype={config.model.compute_dtype}), or train it as is with "
      "--config.optim.allow_low_precision_params=True")


def _validate_rest(config, errs):
  s, o, v = config.sampling, config.optim, config.verifier
  if not (isinstance(s.max_new_tokens, int) and s.max_new_tokens >= 1):
    errs.append(f"sampling.max_new_tokens={s.max_new_tokens!r}: must be an integer >= 1")
  if config.train.steps > 0 and not s.temperature > 0:
    errs.append(f"sampling.temperature={s.temperature!r}: training rollouts need a temperature "
                "> 0 (at 0 every sample of a group is the same greedy answer, so every "
                "advantage and gradient is 0); use sampling.eval_temperature for greedy eval")
  if not s.eval_temperature >= 0:
    errs.append(f"sampling.eval_temperature={s.eval_temperature!r}: must be >= 0 (0 = greedy)")
  if not 0 < s.top_p <= 1:
    errs.append(f"sampling.top_p={s.top_p!r}: must be in (0, 1]")
  if s.top_k < 0:
    errs.append(f"sampling.top_k={s.top_k!r}: must be >= 0 (0 = off)")
  _positive(errs, "optim.learning_rate", o.learning_rate)
  _validate_master(config, errs)
  _positive(errs, "optim.warmup_steps", o.warmup_steps, allow_zero=True)
  _positive(errs, "optim.grad_clip", o.grad_clip, allow_zero=True)
  _positive(errs, "optim.weight_decay", o.weight_decay, allow_zero=True)
  _choice(errs, "optim.schedule", o.schedule, ("constant", "cosine"))
  if not (0 <= o.b1 < 1 and 0 <= o.b2 < 1):
    errs.append(f"optim.b1={o.b1}, optim.b2={o.b2}: must be in [0, 1)")
  _choice(errs, "verifier.backend", v.backend, ("thread", "process"))
  # verifier.reward_range: two numbers lo < hi that float32 holds (|bound| < 3e38, as
  # VerifierPool checks; rewards are float32 on the device), with a spread that keeps the
  # advantages' variance finite: the kernels sum (r - mean)^2 over up to N rewards of a
  # step (batch_std pools them all; N = prompts_per_step * group_size, x2 with round 2),
  # at most N * (hi - lo)^2 / 4, and past float32's largest value that sum is inf and
  # every advantage silently 0.
  f32_max, bound = 3.4028234663852886e38, 3.0e38
  rr = v.reward_range
  pair = tuple(rr) if isinstance(rr, (tuple, list)) else ()
  field = f"verifier.reward_range={pair if pair else rr!r}"
  lo = hi = None
  if len(pair) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                               for x in pair):
    errs.append(f"{field}: must be a pair of numbers (lo, hi)")
  elif not all(math.isfinite(x) for x in pair):
    errs.append(f"{field}: both bounds must be finite numbers")
  elif not pair[0] < pair[1]:
    errs.append(f"{field}: must have lo < hi")
  elif max(abs(pair[0]), abs(pair[1])) >= bound:
    errs.append(f"{field}: each bound must satisfy |bound| < {bound:g} (rewards are float32 "
                f"on the device; its largest value is {f32_max:.3g})")
  else:
    lo, hi = float(pair[0]), float(pair[1])
  rl = config.rl
  if lo is not None and isinstance(rl.prompts_per_step, int) and isinstance(rl.group_size, int):
    rounds = 2 if rl.get("round2") else 1
    n = max(rl.prompts_per_step * rl.group_size * rounds, 1)
    spread = math.sqrt(4.0 * f32_max / n)
    if hi - lo >= spread:
      errs.append(
          f"{field}: hi - lo = {hi - lo:.3g} must be < {spread:.3g}: the sum of squared "
          f"deviations of a step's N={n} rewards (rl.prompts_per_step x rl.group_size"
          f"{' x 2 rounds' if rounds == 2 else ''}), up to N * (hi - lo)^2 / 4, must stay "
          f"below float32's largest value {f32_max:.3g}, or the advantages' variance is inf "
          "and every advantage becomes 0")
  _positive(errs, "verifier.timeout_s", v.timeout_s)
  _positive(errs, "verifier.workers", v.workers)
  if not 0 <= config.data.eval_fraction < 1:
    errs.append(f"data.eval_fraction={config.data.eval_fraction!r}: must be in [0, 1)")
  if config.train.warm_start not in ("", "sft"):
    errs.append(f"train.warm_start={config.train.warm_start!r}: expected '' or 'sft'")
  if config.train.warm_start == "sft":
    errs.extend(sft_errors(config))


# ----------------------------------------------------------------------------- the warm start

SFT_SCHEDULES = ("cosine", "constant")
SFT_CORRECTIONS = ("corrupt", "self")
STAGE_KEYS = ("name",)  # a stage's keys besides sft fields


def stage_name(i: int, stage) -> str:
  """Stage ``i``'s name: its ``name`` key, else ``stage{i + 1}``."""
  return str(stage.get("name", f"stage{i + 1}"))


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _sft_values(sft: dict, name, errs):
  """The rules of one SFT recipe's fields (the flat ``sft.*`` or a stage over them);
  ``name(field)`` is how the message names a field."""
  def count(f, least):
    v = sft.get(f)
    if not (_is_int(v) and v >= least):
      errs.append(f"{name(f)}={v!r}: must be an integer >= {least}")
  def share(f):
    v = sft.get(f)
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1):
      errs.append(f"{name(f)}={v!r}: must be in [0, 1]")
  count("steps", 1)
  count("batch_size", 1)
  count("warmup_steps", 0)
  count("self_samples", 1)
  lr = sft.get("learning_rate")
  if isinstance(lr, bool):
    lr = None
  _positive(errs, name("learning_rate"), lr)
  share("fap_fraction")
  share("self_corrections_from")
  _choice(errs, name("schedule"), sft.get("schedule"), SFT_SCHEDULES)
  _choice(errs, name("corrections"), sft.get("corrections"), SFT_CORRECTIONS)
  if not isinstance(sft.get("conditional"), bool):
    errs.append(f"{name('conditional')}={sft.get('conditional')!r}: must be True or False")


def sft_errors(config) -> list:
  """Every bad value of the warm start's recipe, named: the flat ``sft.*`` fields
  (no stages), or each stage of ``sft.stages`` as the whole recipe it runs (its
  fields over the flat ones), a field the stage sets named
  ``sft.stages[i].field``; and ``sft.steps``, with stages their total."""
  sft = config.sft
  flat = {k: v for k, v in sft.items() if k != "stages"}
  stages = sft.get("stages", ()) or ()
  errs: list[str] = []
  if not isinstance(stages, (tuple, list)):
    return [f"sft.stages={stages!r}: must be a tuple of dicts, one per stage (() = one "
            "stage made of the flat sft fields)"]
  if not stages:
    _sft_values(flat, lambda f: f"sft.{f}", errs)
    return errs
  steps = []
  for i, st in enumerate(stages):
    if not hasattr(st, "keys"):
      errs.append(f"sft.stages[{i}]={st!r}: must be a dict of sft fields (and 'name'), "
                  f"e.g. {{'name': 'demos', 'steps': 100}}")
      continue
    st = dict(st)
    bad = sorted(k for k in st if k not in flat and k not in STAGE_KEYS)
    if bad:
      errs.append(f"sft.stages[{i}] ({stage_name(i, st)!r}): unknown sft field(s) {bad}; a "
                  f"stage sets fields of the sft section: {sorted(flat)} (and 'name')")
    mine = [k for k in st if k in flat]
    _sft_values(dict(flat, **{k: st[k] for k in mine}),
                lambda f, i=i: f"sft.stages[{i}].{f}" if f in mine else f"sft.{f}", errs)
    steps.append((stage_name(i, st), st.get("steps", flat.get("steps"))))
  if len(steps) == len(stages) and all(_is_int(n) and n >= 1 for _, n in steps):
    total = sum(n for _, n in steps)
    if sft.steps != total:
      listed = " + ".join(f"{name} {n}" for name, n in steps)
      errs.append(
          f"sft.steps={sft.steps!r}, but the steps of sft.stages total {total} ({listed}): with "
          f"stages each stage sets its own steps and sft.steps is their total, so a value "
          f"of its own would be ignored; set the stages' steps (--config.sft.stages=...) and "
          f"sft.steps to their sum")
  return list(dict.fromkeys(errs))


def stage_override_errors(config, overrides) -> list:
  """Overrides (dotted fields set on top of the config file, as
  ``--config.sft.learning_rate=...`` does) of flat ``sft.*`` fields that a stage
  of ``sft.stages`` sets itself: the stage would ignore them, so they are
  refused, naming the stages (``sft.steps`` is checked as the stages' total)."""
  stages = [dict(st) for st in (config.sft.get("stages", ()) or ()) if hasattr(st, "keys")]
  errs = []
  for dotted in overrides:
    section, _, field = str(dotted).partition(".")
    if section != "sft" or field in ("steps", "stages") or "." in field:
      continue
    setting = [f"sft.stages[{i}].{field}={st[field]!r} ({stage_name(i, st)!r})"
               for i, st in enumerate(stages) if field in st]
    if setting:
      errs.append(f"sft.{field}={config.sft[field]!r} would be ignored by the stage(s) that "
                  f"set it themselves: {', '.join(setting)}; set it in the stages "
                  "(--config.sft.stages=...) instead")
  return errs
