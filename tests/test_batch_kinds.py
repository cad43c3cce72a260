"""The table of batch kinds (fbos_jax/rl/batch_kinds.py) is the one home of their facts."""
import pathlib
import re

import pytest

import configs
from fbos_jax.rl import batch_kinds
from fbos_jax.rl import config as config_lib
from fbos_jax.rl import rollout
from fbos_jax.rl import shapes

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "fbos_jax"
HOME = "rl/batch_kinds.py"
# "fcp" names three things: the batch kind, the rl.prompt mode (round 1 under <EF>c+</EF>q)
# and the FCP template's key; the other two keep their own one home each.
OTHER_MEANINGS = {"fcp": {"rl/config.py": "rl.prompt's mode (RolloutSpec.conditional)",
                          "templates.py": "the FCP template's key (templates.FCP_KIND)"}}


def _modules_naming(name: str) -> set:
  pattern = re.compile(r"""["']%s["']""" % re.escape(name))
  return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
          if pattern.search(p.read_text())}


@pytest.mark.parametrize("name", batch_kinds.NAMES)
def test_each_kind_is_named_as_a_literal_in_one_module(name):
  """grep '"epa"' fbos_jax finds the table only (the rest reads it)."""
  found = _modules_naming(name)
  assert HOME in found
  extra = found - {HOME} - set(OTHER_MEANINGS.get(name, {}))
  assert not extra, (f"batch kind {name!r} written as a literal in {sorted(extra)}; read it "
                     f"from fbos_jax/{HOME} (batch_kinds.KINDS / batch_kinds.EPA.name ...)")


def test_the_table_is_what_the_package_reads():
  assert batch_kinds.NAMES == ("epa", "ecc", "fcp")
  assert set(configs.load("fbos:tiny").rl.terms) == set(batch_kinds.NAMES)
  for k in batch_kinds.KINDS.values():
    assert callable(getattr(rollout, k.builder)), k.builder
  c = configs.load("fbos:tiny")
  parts = config_lib.build_parts(c)
  spec = parts.rollout
  n, m, a = spec.group_size, spec.round2_size, spec.epa_extra
  assert a == c.rl.epa_max_per_prompt > 0
  assert {k: shapes.batch_rows(parts, k) for k in batch_kinds.NAMES} == {
      "epa": 8 * (n + a), "ecc": 8 * m, "fcp": 8 * n}
  assert shapes.batch_prompt_buckets(parts, "epa") == (tuple(c.sampling.prompt_buckets),
                                                       "sampling.prompt_buckets")
  for k in ("ecc", "fcp"):
    assert shapes.batch_prompt_buckets(parts, k) == (tuple(c.sampling.fap_prompt_buckets),
                                                     "sampling.fap_prompt_buckets")
  from fbos_jax.rl import objectives
  assert objectives.ROUND1_BATCH == "epa"


def test_an_unknown_batch_names_the_kinds():
  with pytest.raises(ValueError, match=r"unknown batch 'epb'; the rollout builds epa \| ecc \| fcp"):
    batch_kinds.kind("epb")


def test_a_round2_kind_without_round2_is_refused_by_field():
  c = configs.load("grpo:tiny", {"rl.terms.ecc.weight": 1.0})
  with pytest.raises(ValueError, match=r"rl\.terms\.ecc\.weight=1\.0 > 0 .*rl\.round2=True"):
    config_lib.validate(c, process_count=1)
  c = configs.load("fbos:tiny", {"rl.terms.ecc.weight": 0.0, "rl.terms.epa.weight": 0.0,
                                 "rl.terms.fcp.weight": 1.0})
  with pytest.raises(ValueError, match=r"none of rl\.terms\.epa, rl\.terms\.ecc uses them"):
    config_lib.validate(c, process_count=1)
