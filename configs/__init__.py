"""The run configs, one ``get_config(arg)`` per algorithm file (big_vision style).

:func:`load` is the one loader outside absl (tests, ``fbos_jax/experiments/compare.py``,
notebooks): ``load("configs/fbos.py:tiny")`` or ``load("fbos:tiny")`` gives the
ConfigDict that ``--config=configs/fbos.py:tiny`` gives ``launch/train.py``,
and ``overrides`` set dotted fields as ``--config.a.b=v`` does
(:func:`configs.base.set_field`, the one dotted setter).
"""

import importlib
import os

from configs.base import set_field  # noqa: F401  (re-exported: the one dotted setter)

ALGORITHMS = ("grpo", "gfpo", "golf", "fbos", "fcp", "sft")


def load(spec: str, overrides: dict | None = None):
  """``configs/NAME.py:ARG`` (or ``NAME:ARG``) -> the config, with ``overrides``
  ({dotted field: value}) applied."""
  path, _, arg = spec.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  if name not in ALGORITHMS:
    raise ValueError(f"unknown config file {path!r}; expected configs/<one of "
                     f"{', '.join(ALGORITHMS)}>.py")
  module = importlib.import_module(f"configs.{name}")
  c = module.get_config(arg) if arg else module.get_config()
  for dotted, value in (overrides or {}).items():
    set_field(c, dotted, value)
  return c
