"""Host-side page bookkeeping: one free list and reference counts per batch shard.

Page 0 of every shard is the null page (padding and idle rows write there) and
is never handed out. A page shared by the samples of one prompt (its full
prompt pages) carries one reference per sample and returns to the free list
when the last one releases it.
"""

from __future__ import annotations

import numpy as np

from fbos_jax.engine.types import EngineError


class PageAllocator:
  """Free lists of ``shards`` pools of ``pages_per_shard`` pages (page 0 = null)."""

  def __init__(self, shards: int, pages_per_shard: int):
    if pages_per_shard < 2:
      raise EngineError(f"a shard's pool needs at least 2 pages (the null page and one "
                        f"more); got {pages_per_shard}.")
    self.shards = int(shards)
    self.pages_per_shard = int(pages_per_shard)
    self._free = [list(range(pages_per_shard - 1, 0, -1)) for _ in range(self.shards)]
    self._refs = np.zeros((self.shards, pages_per_shard), np.int32)
    self.peak = 0

  @property
  def capacity(self) -> int:
    """Pages that can be handed out, all shards (null pages excluded)."""
    return self.shards * (self.pages_per_shard - 1)

  def in_use(self) -> int:
    return self.capacity - sum(len(f) for f in self._free)

  def alloc(self, shard: int, count: int, refs: int = 1) -> list:
    """``count`` pages of ``shard``, each with ``refs`` references."""
    free = self._free[shard]
    if count > len(free):
      raise EngineError(f"batch shard {shard} is out of KV pages: {count} wanted, "
                        f"{len(free)} free of {self.pages_per_shard - 1}; raise "
                        "engine.num_pages (or lower engine.slots).")
    out = [free.pop() for _ in range(count)]
    self._refs[shard, out] = refs
    self.peak = max(self.peak, self.in_use())
    return out

  def release(self, shard: int, pages) -> None:
    """Drop one reference of each page; a page with none left is free again."""
    for p in pages:
      r = self._refs[shard, p]
      if r <= 0:
        raise EngineError(f"page {p} of shard {shard} released more often than allocated.")
      self._refs[shard, p] = r - 1
      if r == 1:
        self._free[shard].append(int(p))

  def check_all_free(self) -> None:
    """Raise unless every page is free (called after every engine run)."""
    if self.in_use() or self._refs.any():
      raise EngineError(f"{self.in_use()} KV page(s) still in use after the run "
                        f"(references: {int(self._refs.sum())}): a page leaked.")
