"""The prompt data pipeline on grain: sources, per-host shards, resumable state.

Entry point::

  it = make_prompt_iterator(config.data, batch_size=8)   # host-local batch
  batch = next(it)            # list of 8 example dicts (prompt, answer, id, ...)
  state = it.get_state()      # JSON-serializable dict; store it with the
  ...                         # checkpoint (e.g. orbax ``args.JsonSave``)
  it = make_prompt_iterator(config.data, batch_size=8)
  it.set_state(state)         # continues with exactly the next batch

**Sources** (``source``):
  * ``"jsonl"`` / ``"parquet"``: ``path`` is a file, a glob, or a
    comma-separated list of them, local or on any fsspec filesystem
    (``gs://``, ``s3://``, ``file://`` ...). Files are read whole into host
    memory when the iterator is made (prompt sets are small); each record
    needs ``prompt_field`` and may have ``answer_field`` / ``id_field``.
    A JSONL line that is not a JSON object, or a record without the prompt
    field, is *malformed*: ``on_malformed="error"`` raises
    ``MalformedRecordError("<file>:<line>: ...")``; ``"skip"`` drops it and
    counts it in ``stats()["data/malformed_skipped"]``.
  * ``"procedural"``: ``tasks.ProceduralSource``; example ``i`` is generated
    from ``(generation_seed, i)``, so an "infinite" source (``num_examples=0``)
    is just an index space. ``split="eval"`` draws from a problem set disjoint
    from ``"train"`` (see ``tasks.py``).

**Order**: global shuffle with ``shuffle_seed`` (re-seeded every epoch), then
``num_epochs`` repeats (0 = forever), then the per-host shard: host ``p`` of
``P`` takes global positions ``p, p+P, p+2P, ...``. So within every epoch
the hosts' streams are disjoint and together cover the data. Infinite
procedural sources are already i.i.d. per index and are not shuffled.

**Over-long prompts** (``max_prompt_chars`` and/or ``max_prompt_tokens``, 0 =
no limit; tokens need ``tokenizer=`` and count the rendered prompt, chat
template included): ``over_long="filter"`` drops the example, ``"truncate"``
keeps the prompt's beginning, ``"error"`` raises. Counts are in ``stats()``.

**Resume**: the state is grain's iterator state plus the counters, taken
between batches; nothing is buffered ahead of it (grain's prefetch tracks the
consumed position), so a restored iterator yields exactly the examples the
original would have yielded next (the failure mode of tunix #2290). The state
records a fingerprint of the order-defining config and the shard; restoring
it under a different one raises instead of silently skipping data.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterator

import grain
import ml_collections

from fbos_jax import tasks

STATE_VERSION = 1


class MalformedRecordError(ValueError):
  """A data record could not be read; the message names file and line."""


def default_data_config() -> ml_collections.ConfigDict:
  """The data section of a config (``config.data``); see the module doc."""
  return ml_collections.ConfigDict({
      "source": "procedural",  # "procedural" | "jsonl" | "parquet"
      "path": "",  # jsonl/parquet: file, glob or comma list; any fsspec URL
      # Procedural: task family, or a comma list mixed round-robin.
      "task": "arithmetic",
      "difficulty": 1,  # procedural difficulty (digits, list length, ...)
      "max_difficulty": 0,  # >0: per-example difficulty in [difficulty, this]
      "num_examples": 0,  # procedural: 0 = infinite index space
      "generation_seed": 0,  # procedural content seed (not the order seed)
      "split": "train",  # "train" | "eval"; procedural eval is disjoint
      "verifier": "procedural",  # registered name or "package.module:attr"
      "feedback_reveals_answer": False,  # passed to the verifier
      "shuffle": True,
      "shuffle_seed": 0,
      "num_epochs": 0,  # 0 = repeat forever
      "prompt_field": "prompt",
      "answer_field": "answer",
      "id_field": "id",
      "max_prompt_chars": 0,  # 0 = no limit
      "max_prompt_tokens": 0,  # 0 = no limit; needs a tokenizer
      "over_long": "filter",  # "filter" | "truncate" | "error"
      "on_malformed": "error",  # "error" | "skip"
      "drop_remainder": True,  # drop the last partial batch of finite data
      "read_threads": 4,  # grain worker threads building examples
  })


# ---------------------------------------------------------------------------
# Reading files.


def expand_paths(path: str) -> list[str]:
  """Comma list of files/globs (any fsspec URL) -> sorted concrete paths."""
  import fsspec  # pylint: disable=g-import-not-at-top

  out = []
  for p in (s.strip() for s in path.split(",")):
    if not p:
      continue
    files = fsspec.open_files(p, mode="rb")
    if not files:
      raise FileNotFoundError(f"no data files match {p!r}")
    protocols = files.fs.protocol
    local = "file" in (protocols if isinstance(protocols, tuple) else (protocols,))
    # Local files keep plain paths, so error messages name them as given.
    out.extend(sorted(f.path if local else f.full_name for f in files))
  return out


def _normalize(record: Any, where: str, cfg) -> dict:
  """Record -> example dict with str prompt/answer/id (or raises)."""
  if not isinstance(record, dict):
    raise MalformedRecordError(
        f"{where}: expected a JSON object, got {type(record).__name__}")
  prompt = record.get(cfg.prompt_field)
  if prompt is None:
    raise MalformedRecordError(f"{where}: missing field {cfg.prompt_field!r}")
  ex = dict(record)
  ex["prompt"] = str(prompt)
  answer = record.get(cfg.answer_field)
  ex["answer"] = None if answer is None else (
      answer if isinstance(answer, str) else json.dumps(answer))
  rid = record.get(cfg.id_field)
  ex["id"] = str(rid) if rid is not None else where
  ex.setdefault("verifier", cfg.verifier)
  return ex


def read_jsonl(path: str, cfg) -> tuple[list[dict], int]:
  """Reads one JSONL file -> (examples, malformed lines skipped)."""
  import fsspec  # pylint: disable=g-import-not-at-top

  with fsspec.open(path, "rb") as f:
    data = f.read()
  name = os.path.basename(path.rstrip("/"))
  out, skipped = [], 0
  for lineno, line in enumerate(data.splitlines(), start=1):
    if not line.strip():
      continue  # blank lines (e.g. at the end) are not records
    where = f"{path}:{lineno}"
    try:
      try:
        record = json.loads(line)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MalformedRecordError(f"{where}: malformed JSON ({e})") from None
      ex = _normalize(record, where, cfg)
      if cfg.id_field not in record:
        ex["id"] = f"{name}:{lineno}"
      out.append(ex)
    except MalformedRecordError:
      if cfg.on_malformed != "skip":
        raise
      skipped += 1
  return out, skipped


def read_parquet(path: str, cfg) -> tuple[list[dict], int]:
  """Reads one Parquet file -> (examples, malformed rows skipped)."""
  import fsspec  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  with fsspec.open(path, "rb") as f:
    rows = pq.read_table(f).to_pylist()
  name = os.path.basename(path.rstrip("/"))
  out, skipped = [], 0
  for i, record in enumerate(rows):
    try:
      ex = _normalize(record, f"{path}:row {i}", cfg)
      if cfg.id_field not in record or record.get(cfg.id_field) is None:
        ex["id"] = f"{name}:{i}"
      out.append(ex)
    except MalformedRecordError:
      if cfg.on_malformed != "skip":
        raise
      skipped += 1
  return out, skipped


def load_records(cfg) -> tuple[list[dict], int]:
  """All examples of a jsonl/parquet config -> (examples, skipped count)."""
  if cfg.on_malformed not in ("error", "skip"):
    raise ValueError(f"on_malformed must be 'error' or 'skip': {cfg.on_malformed!r}")
  reader = {"jsonl": read_jsonl, "parquet": read_parquet}[cfg.source]
  records, skipped = [], 0
  for p in expand_paths(cfg.path):
    r, s = reader(p, cfg)
    records.extend(r)
    skipped += s
  if not records:
    raise ValueError(f"no usable records in {cfg.path!r}")
  return records, skipped


# ---------------------------------------------------------------------------
# The dataset and the iterator.


def build_dataset(cfg, *, process_index: int, process_count: int
                  ) -> tuple[grain.MapDataset, int]:
  """The host's grain ``MapDataset`` of example dicts (before length checks).

  Returns:
    ``(dataset, malformed_skipped)``.
  """
  if not 0 <= process_index < process_count:
    raise ValueError(f"bad shard {process_index} of {process_count}")
  skipped = 0
  if cfg.source == "procedural":
    src = tasks.ProceduralSource(
        cfg.task, seed=cfg.generation_seed, difficulty=cfg.difficulty,
        max_difficulty=cfg.max_difficulty or None, split=cfg.split,
        num_examples=cfg.num_examples or None)
    ds = grain.MapDataset.source(src)
    finite = bool(cfg.num_examples)
  elif cfg.source in ("jsonl", "parquet"):
    records, skipped = load_records(cfg)
    ds = grain.MapDataset.source(records)
    finite = True
  else:
    raise ValueError(f"unknown data source {cfg.source!r}")
  if finite:
    if cfg.shuffle:
      ds = ds.shuffle(seed=cfg.shuffle_seed)
    ds = ds.repeat(cfg.num_epochs or None)
  ds = ds[process_index::process_count]
  return ds, skipped


def _fingerprint(cfg, process_index: int, process_count: int,
                 batch_size: int) -> str:
  keys = ("source", "path", "task", "difficulty", "max_difficulty",
          "num_examples", "generation_seed", "split", "shuffle",
          "shuffle_seed", "num_epochs", "prompt_field", "max_prompt_chars",
          "max_prompt_tokens", "over_long", "on_malformed")
  blob = json.dumps([[k, cfg.get(k)] for k in keys] +
                    [process_index, process_count, batch_size], default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


class PromptIterator:
  """Yields host-local batches (lists of example dicts); resumable.

  Not a grain ``DatasetIterator`` itself: it wraps one, applies the
  over-long policy and batches on the host. ``get_state`` / ``set_state``
  round-trip a JSON-serializable dict.
  """

  def __init__(self, ds: grain.MapDataset, cfg, *, batch_size: int,
               fingerprint: str, malformed_skipped: int = 0, tokenizer=None):
    if batch_size < 1:
      raise ValueError("batch_size must be >= 1")
    if cfg.over_long not in ("filter", "truncate", "error"):
      raise ValueError(f"over_long must be filter|truncate|error: {cfg.over_long!r}")
    if cfg.max_prompt_tokens and tokenizer is None:
      raise ValueError("max_prompt_tokens needs make_prompt_iterator(tokenizer=...)")
    self._ds = ds
    self._cfg = cfg
    self.batch_size = batch_size
    self._tokenizer = tokenizer
    self._fingerprint = fingerprint
    self._malformed_skipped = malformed_skipped
    self._counts = {"examples": 0, "batches": 0, "filtered_over_long": 0,
                    "truncated_over_long": 0}
    self._it = self._new_grain_iterator()

  def _new_grain_iterator(self):
    opts = grain.ReadOptions(num_threads=max(1, int(self._cfg.read_threads)),
                             prefetch_buffer_size=max(2, 2 * self.batch_size))
    return iter(self._ds.to_iter_dataset(opts))

  # -- over-long policy ------------------------------------------------------

  def _token_len(self, text: str) -> int:
    from fbos_jax.templates import render_prompt  # pylint: disable=g-import-not-at-top
    return len(render_prompt(self._tokenizer, text))

  def _apply_length_policy(self, ex: dict) -> dict | None:
    """Returns the example (maybe truncated) or None if filtered."""
    cfg, prompt = self._cfg, ex["prompt"]
    too_long_chars = cfg.max_prompt_chars and len(prompt) > cfg.max_prompt_chars
    n_tok = self._token_len(prompt) if cfg.max_prompt_tokens else 0
    too_long_tokens = cfg.max_prompt_tokens and n_tok > cfg.max_prompt_tokens
    if not (too_long_chars or too_long_tokens):
      return ex
    if cfg.over_long == "error":
      raise ValueError(
          f"example {ex.get('id')!r}: prompt has {len(prompt)} chars / "
          f"{n_tok or '?'} tokens, over max_prompt_chars="
          f"{cfg.max_prompt_chars} / max_prompt_tokens={cfg.max_prompt_tokens}"
          " (over_long='error')")
    if cfg.over_long == "filter":
      self._counts["filtered_over_long"] += 1
      return None
    if too_long_chars:
      prompt = prompt[:cfg.max_prompt_chars]
    if cfg.max_prompt_tokens:
      ids = self._tokenizer.encode(prompt, add_special_tokens=False)
      keep = len(ids) - max(0, self._token_len(prompt) - cfg.max_prompt_tokens)
      while keep > 0:  # the chat template adds a fixed overhead
        prompt = self._tokenizer.decode(ids[:keep])
        if self._token_len(prompt) <= cfg.max_prompt_tokens:
          break
        keep -= 1
      if keep <= 0:
        raise ValueError(f"max_prompt_tokens={cfg.max_prompt_tokens} leaves no"
                         " room for any prompt text")
    self._counts["truncated_over_long"] += 1
    ex = dict(ex, prompt=prompt, truncated=True)
    return ex

  # -- iteration -------------------------------------------------------------

  def __iter__(self) -> Iterator[list[dict]]:
    return self

  def __next__(self) -> list[dict]:
    batch: list[dict] = []
    while len(batch) < self.batch_size:
      try:
        ex = next(self._it)
      except StopIteration:
        if batch and not self._cfg.drop_remainder:
          break
        raise
      ex = self._apply_length_policy(ex)
      if ex is not None:
        batch.append(ex)
    self._counts["examples"] += len(batch)
    self._counts["batches"] += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    """A JSON-serializable snapshot, valid between batches."""
    return {"version": STATE_VERSION, "fingerprint": self._fingerprint,
            "grain": self._it.get_state(), "counts": dict(self._counts)}

  def set_state(self, state: dict[str, Any]) -> None:
    """Restores ``get_state()`` output (from the same config and shard)."""
    if state.get("version") != STATE_VERSION:
      raise ValueError(f"unsupported data iterator state version "
                       f"{state.get('version')!r}")
    if state.get("fingerprint") != self._fingerprint:
      raise ValueError(
          "data iterator state was saved with a different data config, shard "
          "or batch size; resuming would not see the same examples "
          f"(saved {state.get('fingerprint')}, now {self._fingerprint})")
    self._it = self._new_grain_iterator()
    self._it.set_state(state["grain"])
    self._counts = dict(state["counts"])

  def stats(self) -> dict[str, float]:
    """Counters since the start of training (restored with the state)."""
    out = {f"data/{k}": float(v) for k, v in self._counts.items()}
    out["data/malformed_skipped"] = float(self._malformed_skipped)
    return out


def make_prompt_iterator(
    data_config: ml_collections.ConfigDict,
    *,
    batch_size: int,
    process_index: int | None = None,
    process_count: int | None = None,
    seed: int | None = None,
    tokenizer=None,
) -> PromptIterator:
  """Builds this host's resumable iterator of prompt batches.

  Args:
    data_config: ``default_data_config()`` or an override of it.
    batch_size: examples per host-local batch (prompts, before the group of
      n rollouts per prompt).
    process_index / process_count: this host's shard; default
      ``jax.process_index()`` / ``jax.process_count()``.
    seed: overrides ``data_config.shuffle_seed`` when given.
    tokenizer: needed only for ``max_prompt_tokens``.

  Returns:
    A ``PromptIterator``: ``next(it)`` is a list of ``batch_size`` example
    dicts (fewer only for the last batch of finite data with
    ``drop_remainder=False``).
  """
  if process_index is None or process_count is None:
    import jax  # pylint: disable=g-import-not-at-top
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  cfg = default_data_config()  # fields the caller left out keep defaults
  cfg.update(data_config.to_dict() if hasattr(data_config, "to_dict")
             else dict(data_config))
  if seed is not None:
    cfg.shuffle_seed = int(seed)
  ds, skipped = build_dataset(cfg, process_index=process_index,
                              process_count=process_count)
  return PromptIterator(
      ds, cfg, batch_size=batch_size, malformed_skipped=skipped,
      tokenizer=tokenizer,
      fingerprint=_fingerprint(cfg, process_index, process_count, batch_size))
