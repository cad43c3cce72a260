"""Small shared helpers (private)."""

from __future__ import annotations

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


def safe_sqrt(x: jnp.ndarray) -> jnp.ndarray:
    """sqrt with a finite (zero) gradient at x <= 0 (double-where trick)."""
    pos = x > 0
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, x, 1.0)), 0.0)


def safe_div(num: jnp.ndarray, den: jnp.ndarray) -> jnp.ndarray:
    """num/den where den > 0 else 0, with finite gradients everywhere."""
    pos = den > 0
    return jnp.where(pos, num / jnp.where(pos, den, 1.0), 0.0)
