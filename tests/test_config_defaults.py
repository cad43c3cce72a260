"""Library defaults live in the typed parts: configs/base.py's defaults are theirs,
except the commented changes of base.CHANGED_DEFAULTS; choice lists are the kernels'."""
import dataclasses

import pytest

import configs
import fbos_kernels as K
from configs import base
from fbos_jax.engine import EngineConfig
from fbos_jax.model import qwen
from fbos_jax.rl import config as config_lib
from fbos_jax.sampling import SamplingConfig

# fields of a part that the config does not default: run sizes set by build_parts from
# other sections (the schedule's length from train.steps, the terms from rl.terms)
NOT_DEFAULTS = {"OptimConfig": ("total_steps",), "UpdateConfig": ("terms", "loss"),
                "RolloutSpec": ("terms",)}


def _library_default(f):
  if f.default is not dataclasses.MISSING:
    return f.default
  if f.default_factory is not dataclasses.MISSING:
    return f.default_factory()
  return dataclasses.MISSING


def drifts(c, variant: str) -> dict:
  """{config field: (what configs/base.py gives, the typed part's default)} for every
  field of a typed part whose value, built from ``c`` (build_parts), differs from
  the dataclass's default: what a config user gets that a library user does not."""
  parts = config_lib.build_parts(c)
  checked = [("rl", parts.rollout), ("rl", parts.update), ("rl", parts.update.loss),
             ("rl", parts.asynchronous), ("optim", parts.optim),
             ("sampling", parts.sampling.round1), ("model", parts.model)]
  if parts.sampling.engine_config is not None:
    checked.append(("engine", parts.sampling.engine_config))
  architecture = set(base.VARIANTS[variant]["model"])  # the variant's, not a default
  out = {}
  for section, part in checked:
    for f in dataclasses.fields(part):
      default = _library_default(f)
      if (default is dataclasses.MISSING or f.name in NOT_DEFAULTS.get(type(part).__name__, ())
          or (section == "model" and f.name in architecture)):
        continue
      value = getattr(part, f.name)
      if value != default:
        name = config_lib.RL_NAMES.get(f.name, f.name) if section == "rl" else f.name
        out[f"{section}.{name}"] = (value, default)
  return out


@pytest.mark.parametrize("variant", ["tiny", "qwen_8b"])
def test_base_defaults_are_the_typed_parts_defaults(variant):
  """Before any variant or algorithm sets a field, a config user gets the typed
  parts' defaults, except the changes configs/base.py declares (with their reason).
  On main before issue 35 this found 5 drifts: optim.grad_clip (1.0 vs 0.0),
  optim.warmup_steps (10 vs 0), optim.weight_decay (0.01 vs 0.0),
  sampling.max_new_tokens (512 vs 256) and sampling.prompt_buckets."""
  c = base.defaults(variant)
  found = drifts(c, variant)
  declared = {k: tuple(v) if isinstance(v, list) else v for k, v in base.CHANGED_DEFAULTS.items()}
  assert {k: v for k, (v, _) in found.items()} == declared, (
      f"configs/base.py and the typed parts disagree on {sorted(set(found) - set(declared))} "
      f"(config value, library default): "
      f"{ {k: found[k] for k in sorted(set(found) - set(declared))} }; change the dataclass "
      "default, or declare the change in configs/base.py:CHANGED_DEFAULTS with its reason")


def test_a_drift_is_found():
  """A default written in configs/base.py that differs from the typed part's is reported."""
  c = base.defaults("tiny")
  c.optim.grad_clip = 0.5
  c.rl.sync_chunk_mib = 64
  c.rl.ppo_epochs = 2
  found = drifts(c, "tiny")
  assert found["optim.grad_clip"] == (0.5, 1.0)
  assert found["rl.sync_chunk_mib"] == (64 * 2 ** 20, 512 * 2 ** 20)
  assert found["rl.ppo_epochs"] == (2, 1)


def test_a_library_user_gets_the_config_users_optimizer():
  c = configs.load("grpo:qwen_8b")
  lr = c.optim.learning_rate
  assert config_lib.optim_config(c.optim, 5) == config_lib.OptimConfig(learning_rate=lr,
                                                                        total_steps=5)


def test_the_sections_are_generated_from_the_parts():
  """configs/base.py's rl, optim, sampling and model attention fields are the parts'."""
  c = base.defaults("tiny")
  for section in ("rl", "optim", "sampling", "model"):
    lib = config_lib.section_defaults(section)
    assert set(lib) <= set(c[section])
  assert set(config_lib.section_defaults("rl")) | {"prompts_per_step", "group_size"} == set(c.rl)
  assert c.engine.to_dict() == {f.name: f.default for f in dataclasses.fields(EngineConfig)}
  assert qwen.ModelConfig().attention == c.model.attention
  assert SamplingConfig().temperature == c.sampling.temperature


# ----------------------------------------------------------------------------- choice lists

REGISTRIES = {"rl.advantage": K.ADVANTAGE_ESTIMATORS, "rl.loss_agg": K.AGGREGATION_MODES,
              "rl.gfpo_metric": K.GFPO_METRICS, "rl.kl_kind": K.KL_ESTIMATORS,
              "rl.offpolicy_ratio_denominator": K.RATIO_DENOMINATORS}


@pytest.mark.parametrize("field", sorted(REGISTRIES))
def test_choice_lists_are_the_kernels_registries(field):
  """Every name of the kernels' registry is accepted; another is refused, naming
  the config field and the registry's names."""
  assert tuple(config_lib.choice_fields()[field]) == tuple(REGISTRIES[field])
  for choice in REGISTRIES[field]:
    c = configs.load("grpo:tiny", {field: choice})
    config_lib.validate(c, process_count=1)
  c = configs.load("grpo:tiny", {field: "nope"})
  with pytest.raises(ValueError) as e:
    config_lib.validate(c, process_count=1)
  assert f"{field}='nope': expected one of {' | '.join(REGISTRIES[field])}" in str(e.value)


@pytest.mark.parametrize("loss", [n for n in K.POLICY_LOSSES if n != "mle"])
def test_every_loss_that_takes_advantages_needs_a_group(loss):
  """Group-normalised advantages of one sample are 0: every registry loss that takes
  advantages (fbos_kernels.ADVANTAGE_LOSSES) needs rl.group_size >= 2."""
  c = configs.load("grpo:tiny", {"rl.group_size": 1, "rl.terms.epa.loss": loss})
  with pytest.raises(ValueError, match=r"rl\.group_size=1: group-normalised advantages"):
    config_lib.validate(c, process_count=1)
