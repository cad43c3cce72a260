"""Small shared helpers (private): masks, dtypes, safe arithmetic, shape and parameter checks."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax.numpy as jnp


def as_bool_mask(mask) -> jnp.ndarray:
  """Bool or float/int mask -> bool mask (non-zero means 'present')."""
  mask = jnp.asarray(mask)
  if mask.dtype == jnp.bool_:
    return mask
  return mask != 0


def float_dtype(x) -> jnp.dtype:
  """At least float32: bf16/f16/int inputs are computed in float32, f64 stays f64."""
  return jnp.promote_types(jnp.asarray(x).dtype, jnp.float32)


def as_float(x) -> jnp.ndarray:
  """``x`` as an array of at least float32 (ints and bools are converted, never truncated to)."""
  x = jnp.asarray(x)
  return x.astype(float_dtype(x))


def safe_sqrt(x: jnp.ndarray) -> jnp.ndarray:
  """sqrt with a finite (zero) gradient at x <= 0 (double-where trick)."""
  pos = x > 0
  return jnp.where(pos, jnp.sqrt(jnp.where(pos, x, 1.0)), 0.0)


def safe_div(num: jnp.ndarray, den: jnp.ndarray) -> jnp.ndarray:
  """num/den where den > 0 else 0, with finite gradients everywhere."""
  pos = den > 0
  return jnp.where(pos, num / jnp.where(pos, den, 1.0), 0.0)


# --------------------------------------------------------------------------
# validation (static: shapes and concrete Python numbers only, so jit is unaffected)
# --------------------------------------------------------------------------


def check_shape(values_name: str, values_shape: Sequence[int], other_name: str, other_shape: Sequence[int],
                *, allowed: Optional[Sequence[Sequence[int]]] = None) -> None:
  """Raise ``ValueError`` unless ``other_shape`` equals ``values_shape`` exactly (no broadcasting).

  ``allowed`` lists the accepted shapes when there is more than one (e.g. ``adv`` may be ``[B]`` or
  ``[B, T]``); by default the only accepted shape is ``values_shape``.
  """
  other_shape = tuple(other_shape)
  accepted = [tuple(values_shape)] if allowed is None else [tuple(a) for a in allowed]
  if other_shape in accepted:
    return
  want = " or ".join(str(a) for a in accepted)
  raise ValueError(f"{other_name} has shape {other_shape} but {values_name} has shape {tuple(values_shape)}: "
                   f"{other_name} must have shape {want} exactly (no broadcasting)")


def is_concrete_number(value) -> bool:
  """True for a Python int/float (numpy float64 included), not bool; traced values are not."""
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_range(name: str, value, *, gt=None, ge=None, lt=None, le=None, extra: str = "") -> None:
  """Range-check a hyperparameter when it is a concrete Python number (traced values pass through).

  Raises ``ValueError`` naming ``name``, the accepted range and the value. NaN is always rejected.
  """
  if not is_concrete_number(value):
    return
  v = float(value)
  ok = not math.isnan(v)
  parts = []
  if gt is not None:
    ok = ok and v > gt
    parts.append(f"> {gt}")
  if ge is not None:
    ok = ok and v >= ge
    parts.append(f">= {ge}")
  if lt is not None:
    ok = ok and v < lt
    parts.append(f"< {lt}")
  if le is not None:
    ok = ok and v <= le
    parts.append(f"<= {le}")
  if not ok:
    accepted = " and ".join(parts) + (f" ({extra})" if extra else "")
    raise ValueError(f"{name} must be {accepted}, got {value!r}")


def check_choice(name: str, value, choices: Sequence[str]) -> None:
  """Raise ``ValueError`` naming ``name`` and the valid choices unless ``value`` is one of them."""
  if value not in choices:
    raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(repr(c) for c in choices)}")
