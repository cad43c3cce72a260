"""Shape buckets and left padding: the one home of the host-side shape helpers.

Every compiled program (sampler, update, log-probs) is built once per shape
bucket, so host code rounds its sizes up to a bucket before anything reaches a
device. A size larger than the largest bucket is an error that names the sizes
and the config field that holds the buckets; nothing is cut silently.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class BucketError(ValueError):
  """A size does not fit the largest bucket; the message names the sizes and field."""


def round_up(x: int, multiple: int) -> int:
  return -(-int(x) // int(multiple)) * int(multiple)


def pick_bucket(n: int, buckets: Sequence[int], *, what: str = "size",
                field: str = "") -> int:
  """The smallest bucket >= n. Raises :class:`BucketError` naming ``n``, the
  largest bucket and ``field`` (e.g. ``sampling.prompt_buckets``) when none fits."""
  fits = [int(b) for b in buckets if int(b) >= int(n)]
  if not fits:
    where = f"; raise {field}" if field else ""
    raise BucketError(f"a {what} of {int(n)} exceeds the largest bucket "
                      f"{max(int(b) for b in buckets)}{where}")
  return min(fits)


def bucket_rows(n: int, multiple: int, min_rows: int = 0) -> int:
  """Row-count bucket: the next power of two (>= multiple), rounded to ``multiple``,
  so that a run compiles a handful of programs, not one per step."""
  n = max(int(n), int(min_rows), 1)
  b = 1
  while b < n:
    b *= 2
  return round_up(max(b, multiple), multiple)


def bucket_count(n: int) -> int:
  """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5x
  them) >= n: counts (a packed batch's micro-batches) that a run compiles a
  handful of programs for, wasting at most a third of a step."""
  n, b = max(int(n), 1), 1
  while True:
    for c in (b, 3 * b // 2):
      if c >= n:
        return c
    b *= 2


def left_pad(seqs: Sequence[Sequence[int]], length: int, pad_id: int, *, rows: int = 0,
             what: str = "prompt", field: str = "") -> tuple[np.ndarray, np.ndarray]:
  """Left-pad token sequences to ``length``.

  Returns (tokens [rows, length] int32, mask [rows, length] int32 with 1 on real
  tokens); ``rows`` (default ``len(seqs)``) adds dummy rows after the real ones,
  each with a single attended pad token so that attention is well defined on them.
  A sequence longer than ``length`` raises :class:`BucketError` (never truncated)."""
  n = len(seqs)
  rows = max(int(rows), n)
  toks = np.full((rows, length), pad_id, np.int32)
  mask = np.zeros((rows, length), np.int32)
  for i, s in enumerate(seqs):
    s = np.asarray(s, np.int64).reshape(-1)
    if s.size > length:
      where = f"; raise {field}" if field else ""
      raise BucketError(f"{what} {i} has {s.size} tokens, more than the padded length "
                        f"{length}{where}")
    if s.size:
      toks[i, length - s.size:] = s
      mask[i, length - s.size:] = 1
  mask[n:, -1] = 1
  return toks, mask
