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
    A JSONL line that is not a JSON object, a record without the prompt
    field, a prompt that is not a string or is empty (blank), a record
    without a field its verifier needs (e.g. ``answer`` for "math",
    ``tests`` for "code": the verifier's ``required_fields``), an answer that
    is not a string nor of a type its verifier declares (``answer_types``;
    answers are never converted), or, when the iterator has a tokenizer, a
    text (prompt, answer, ``solution_field``) holding special-token text or
    a template marker (``templates.forbidden_texts``; with
    ``special_text="escape"`` such a record is kept, its text encoded as plain
    characters, and a warning counts them) is
    *malformed*: ``on_malformed="error"`` raises
    ``MalformedRecordError("<file>:<line>: ...")``; ``"skip"`` drops it,
    counts it in ``stats()["data/malformed_skipped"]`` and logs the count
    with the first few locations when the files are read. Every file example
    carries ``"_location"`` (``"<file>:<line>"``; ``locate(example)`` for
    messages).
    **Held-out split**: ``split="eval"`` returns only held-out records and
    ``split="train"`` never returns them. The held-out set is ``eval_path``
    (a separate file; training also drops records whose prompt is in it, up
    to case and whitespace, with a warning that counts them), or
    else the records whose id (``id_field``; the prompt text when a record
    has no id) hashes into the first ``eval_fraction`` of the hash space:
    deterministic, independent of file order, and records sharing a prompt
    land on the same side. With neither, there is no held-out set and
    ``split="eval"`` raises. ``describe_eval_source(cfg)`` says which.
  * ``"procedural"``: ``tasks.ProceduralSource``; example ``i`` is generated
    from ``(generation_seed, i)``, so an "infinite" source (``num_examples=0``)
    is just an index space. ``split="eval"`` draws from a problem set disjoint
    from ``"train"`` (see ``tasks.py``).

**Verifier** (``verifier``): an explicit name or ``"pkg.module:attr"`` applies
to every example (a dataset ``verifier`` column that names another one is a
``VerifierConflictError`` naming the file and line, rather than being
silently ignored or silently winning); ``"auto"`` (the default) takes each
record's ``verifier`` column (procedural examples: "procedural") and refuses
file records without one. Each example's ``"verifier"`` key holds the result.

**Order**: global shuffle with ``shuffle_seed`` (re-seeded every epoch), then
``num_epochs`` repeats (0 = forever), then the per-host shard: host ``p`` of
``P`` takes global positions ``p, p+P, p+2P, ...``. So within every epoch
the hosts' streams are disjoint and together cover the data. Infinite
procedural sources are already i.i.d. per index and are not shuffled.

**Over-long prompts** (``max_prompt_chars`` and/or ``max_prompt_tokens``, 0 =
no limit; tokens need ``tokenizer=`` and count the rendered prompt, chat
template included): ``over_long="filter"`` drops the example, ``"truncate"``
keeps the prompt's beginning, ``"error"`` raises naming the file:line and id.
Counts are in ``stats()``; the first few filtered / truncated examples are
logged with their location.

**Resume**: the state is grain's iterator state plus the counters, taken
between batches; nothing is buffered ahead of it (grain's prefetch tracks the
consumed position), so a restored iterator yields exactly the examples the
original would have yielded next (the failure mode of tunix #2290). The state
records the order-defining config fields and the shard; restoring it under
different ones raises, naming each differing field, instead of silently
skipping data.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from typing import Any, Iterator

from absl import logging
import grain
import ml_collections

from fbos_jax import tasks
from fbos_jax import templates
from fbos_jax.verifiers import base as verifiers_base

STATE_VERSION = 1
AUTO = verifiers_base.AUTO
LOG_FIRST = 5  # how many skipped / filtered records are named in the log
LOCATION_KEY = "_location"  # "<file>:<line>" of a file example


class MalformedRecordError(ValueError):
  """A data record could not be read; the message names file and line."""


class VerifierConflictError(ValueError):
  """A record's ``verifier`` column contradicts an explicit ``data.verifier``."""


class SpecialTextError(MalformedRecordError):
  """A record's text holds special-token text or a template marker."""


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
      "split": "train",  # "train" | "eval"; eval is disjoint from train
      # Files' held-out set: a separate file (file, glob or comma list) ...
      "eval_path": "",
      # ... or else this share of data.path, by a hash of each record's id
      # (else its prompt), excluded from training. 0 = no held-out set.
      "eval_fraction": 0.05,
      # "auto": each record's "verifier" column (procedural: "procedural");
      # else a registered name or "package.module:attr" for EVERY example.
      "verifier": AUTO,
      "feedback_reveals_answer": False,  # passed to the verifier
      # True: before the warm start, the procedural verifier is run on wrong responses
      # (adversarial ones included) to sample records, and a task whose feedback contains
      # the final answer is refused, with an example record (fbos_jax/verifiers/
      # procedural.py:check_answer_hidden; tiny_chain sets it). Not the verifier's
      # feedback_reveals_answer above, which makes feedback name the answer.
      "require_hidden_answer": False,
      "shuffle": True,
      "shuffle_seed": 0,
      "num_epochs": 0,  # 0 = repeat forever
      "prompt_field": "prompt",
      "answer_field": "answer",
      "solution_field": "",  # SFT demonstrations: this field of a record (else the answer)
      "id_field": "id",
      "max_prompt_chars": 0,  # 0 = no limit
      "max_prompt_tokens": 0,  # 0 = no limit; needs a tokenizer
      "over_long": "filter",  # "filter" | "truncate" | "error"
      "on_malformed": "error",  # "error" | "skip"
      # A record whose text (prompt, answer, solution_field) holds special-token
      # text of the tokenizer or a template marker (templates.forbidden_texts):
      # "refuse" (a malformed record, named file:line) | "escape" (kept, its
      # text encoded as plain characters, never a special token; a warning).
      "special_text": "refuse",
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


@functools.lru_cache(maxsize=None)
def _required_fields(verifier: str) -> tuple[str, ...]:
  return verifiers_base.required_fields(verifier)


@functools.lru_cache(maxsize=None)
def _answer_types(verifier: str) -> tuple[type, ...]:
  return verifiers_base.answer_types(verifier)


def _check_answer(answer: Any, where: str, shown: str, verifier: str) -> None:
  """Raises unless ``answer`` is a string or a type ``verifier`` declares."""
  if answer is None or isinstance(answer, str):
    return
  accepted = _answer_types(verifier)
  kind = type(answer).__name__
  if isinstance(answer, float) and not math.isfinite(answer):
    raise MalformedRecordError(
        f"{where}: field {shown!r} is the number {answer!r} (a JSON number too large "
        "for a float, or NaN), not an answer a verifier can grade; write the answer "
        "as a JSON string")
  ok = isinstance(answer, accepted) and not (
      isinstance(answer, bool) and bool not in accepted)
  if not ok:
    names = ", ".join(t.__name__ for t in accepted)
    raise MalformedRecordError(
        f"{where}: field {shown!r} is a {kind} ({json.dumps(answer, default=str)[:60]}), "
        f"but verifier {verifier!r} grades answers of type {names} (its answer_types); "
        "write the answer as a JSON string exactly as a response must match it "
        "(e.g. \"0042\", not 42): it is not converted, so nothing is graded against "
        "a different text")


def _special_text_fields(record: dict, ex: dict, cfg) -> list[tuple[str, str]]:
  """(shown field name, text) of the record's text that reaches a prompt or
  a training target: the prompt, a string answer, ``solution_field``."""
  out = [(cfg.prompt_field, ex["prompt"])]
  if isinstance(ex.get("answer"), str):
    out.append((cfg.answer_field, ex["answer"]))
  sol = cfg.get("solution_field", "")
  if sol and isinstance(record.get(sol), str):
    out.append((sol, record[sol]))
  return out


def _blank(value: Any) -> bool:
  return value is None or (isinstance(value, str) and not value.strip())


def locate(example: dict) -> str:
  """``"<file>:<line> (id '...')"`` of a file example, ``"id '...'"``
  otherwise: for error messages and logs."""
  where = example.get(LOCATION_KEY)
  rid = example.get("id")
  return f"{where} (id {rid!r})" if where else f"id {rid!r}"


def _normalize(record: Any, where: str, cfg, forbidden: tuple[str, ...] = ()) -> dict:
  """Record -> example dict with str prompt/id (or raises).

  Also resolves the example's verifier (see the module doc), checks that the
  record has every field that verifier requires, that the prompt is a
  non-empty string, that the answer is a string or of a type the verifier
  declares (``answer_types``), and that no text holds one of ``forbidden``
  (special-token text / template markers; ``data.special_text``). An escaped
  record gets ``"_special_text"`` set to the first marker found.
  """
  if not isinstance(record, dict):
    raise MalformedRecordError(
        f"{where}: expected a JSON object, got {type(record).__name__}")
  prompt = record.get(cfg.prompt_field)
  rid = record.get(cfg.id_field)
  if prompt is None:
    raise MalformedRecordError(f"{where}: missing field {cfg.prompt_field!r}")
  if not isinstance(prompt, str):
    raise MalformedRecordError(
        f"{where}: field {cfg.prompt_field!r} is a {type(prompt).__name__}, not a "
        "string (it is not converted)")
  if not prompt.strip():
    raise MalformedRecordError(
        f"{where} (id {str(rid) if rid is not None else where!r}): field "
        f"{cfg.prompt_field!r} is empty; a model cannot be prompted with nothing")
  ex = dict(record)
  ex["prompt"] = prompt
  answer = record.get(cfg.answer_field)
  ex["answer"] = answer
  ex["id"] = str(rid) if rid is not None else where
  ex[LOCATION_KEY] = where
  column = record.get("verifier")
  if cfg.verifier == AUTO:
    if _blank(column):
      raise MalformedRecordError(
          f"{where}: no 'verifier' field, and data.verifier='auto' takes each "
          "record's verifier from it; set data.verifier to the verifier of "
          "these records (e.g. 'math')")
    name = str(column)
  else:
    name = cfg.verifier
    if not _blank(column) and str(column) != name:
      raise VerifierConflictError(
          f"{where}: the record's 'verifier' field says {str(column)!r}, but "
          f"data.verifier={name!r} is set and applies to every example; set "
          "data.verifier='auto' to use the column, or drop the column")
  ex["verifier"] = name
  for field in _required_fields(name):
    if _blank(ex.get(field)):
      shown = {"answer": cfg.answer_field, "prompt": cfg.prompt_field}.get(field, field)
      raise MalformedRecordError(
          f"{where}: missing field {shown!r}, which verifier {name!r} needs "
          "(a record without it would be graded against nothing)")
  _check_answer(answer, where, cfg.answer_field, name)
  if forbidden:
    for shown, text in _special_text_fields(record, ex, cfg):
      marker = templates.find_forbidden(text, forbidden)
      if marker is None:
        continue
      if cfg.get("special_text", "refuse") != "escape":
        raise SpecialTextError(
            f"{where} (id {ex['id']!r}): field {shown!r} holds {marker!r}, which is "
            "special-token text of the tokenizer or a marker of the prompt "
            "templates; the record could forge a turn, an end of text or a "
            "feedback block. Remove it, or set data.special_text='escape' to keep "
            "such text as plain characters")
      ex["_special_text"] = f"field {shown!r} holds {marker!r}"
      break
  # The held-out split's key: the record's own id, else its prompt text.
  ex["_split_key"] = f"id:{rid}" if rid is not None else f"prompt:{ex['prompt']}"
  return ex


def _json_lines(path: str, name: str):
  """(where, record or the error, default id) of each non-blank line of a JSONL file."""
  import fsspec  # pylint: disable=g-import-not-at-top

  with fsspec.open(path, "rb") as f:
    data = f.read()
  for lineno, line in enumerate(data.splitlines(), start=1):
    if not line.strip():
      continue  # blank lines (e.g. at the end) are not records
    where = f"{path}:{lineno}"
    try:
      record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      record = MalformedRecordError(f"{where}: malformed JSON ({e})")
    yield where, record, f"{name}:{lineno}"


def _parquet_rows(path: str, name: str):
  """(where, record, default id) of each row of a Parquet file."""
  import fsspec  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  with fsspec.open(path, "rb") as f:
    rows = pq.read_table(f).to_pylist()
  for i, record in enumerate(rows):
    yield f"{path}:row {i}", record, f"{name}:{i}"


def _read_records(records, cfg, problems: list | None,
                  forbidden: tuple[str, ...]) -> tuple[list[dict], int]:
  """Normalized examples from ``(where, record, default id)`` triples, and the count of
  malformed ones skipped (``data.on_malformed=skip``; otherwise the first one raises)."""
  out, skipped = [], 0
  for where, record, default_id in records:
    try:
      if isinstance(record, MalformedRecordError):
        raise record
      ex = _normalize(record, where, cfg, forbidden)
      if record.get(cfg.id_field) is None:
        ex["id"] = default_id
      out.append(ex)
    except MalformedRecordError as e:
      if cfg.on_malformed != "skip":
        raise
      skipped += 1
      if problems is not None:
        problems.append(str(e))
  return out, skipped


def read_jsonl(path: str, cfg, problems: list | None = None,
               forbidden: tuple[str, ...] = ()) -> tuple[list[dict], int]:
  """Reads one JSONL file -> (examples, malformed lines skipped).

  ``problems`` (optional) collects the skipped lines' error messages;
  ``forbidden``: the texts a record may not hold (``_normalize``).
  """
  name = os.path.basename(path.rstrip("/"))
  return _read_records(_json_lines(path, name), cfg, problems, forbidden)


def read_parquet(path: str, cfg, problems: list | None = None,
                 forbidden: tuple[str, ...] = ()) -> tuple[list[dict], int]:
  """Reads one Parquet file -> (examples, malformed rows skipped)."""
  name = os.path.basename(path.rstrip("/"))
  return _read_records(_parquet_rows(path, name), cfg, problems, forbidden)


def load_records(cfg, path: str | None = None, *,
                 forbidden: tuple[str, ...] = ()) -> tuple[list[dict], int]:
  """All examples of jsonl/parquet files -> (examples, skipped count).

  Args:
    cfg: the data config.
    path: the files to read (default ``cfg.path``; e.g. ``cfg.eval_path``).
    forbidden: texts a record may not hold (``templates.forbidden_texts``;
      ``data.special_text`` says whether such a record is refused or kept).

  Skipped malformed records (``on_malformed="skip"``) are logged once: their
  count and the first few locations and reasons. (No held-out split here:
  ``split_records`` applies it.)
  """
  records, skipped = _load_records(cfg, path, forbidden)
  return _strip(records), skipped


def _load_records(cfg, path: str | None = None,
                  forbidden: tuple[str, ...] = ()) -> tuple[list[dict], int]:
  if cfg.on_malformed not in ("error", "skip"):
    raise ValueError(f"data.on_malformed must be 'error' or 'skip': {cfg.on_malformed!r}")
  if cfg.get("special_text", "refuse") not in ("refuse", "escape"):
    raise ValueError(f"data.special_text must be 'refuse' or 'escape': "
                     f"{cfg.special_text!r}")
  path = cfg.path if path is None else path
  reader = {"jsonl": read_jsonl, "parquet": read_parquet}[cfg.source]
  records, skipped, problems = [], 0, []
  for p in expand_paths(path):
    _protect_from_sandbox(p)
    r, s = reader(p, cfg, problems, forbidden)
    records.extend(r)
    skipped += s
  if skipped:
    logging.warning(
        "data: skipped %d malformed record(s) of %s (data.on_malformed='skip'); "
        "first: %s", skipped, path, " | ".join(problems[:LOG_FIRST]))
  escaped = [r for r in records if r.get("_special_text")]
  if escaped:
    logging.warning(
        "data: %d record(s) of %s hold special-token text or a template marker, "
        "kept as plain characters (data.special_text='escape'; it never becomes a "
        "special token); first: %s", len(escaped), path,
        " | ".join(f"{r[LOCATION_KEY]}: {r['_special_text']}" for r in escaped[:LOG_FIRST]))
  if not records:
    first = f"; first problem: {problems[0]}" if problems else ""
    raise ValueError(f"no usable records in {path!r}{first}")
  return records, skipped


def _protect_from_sandbox(path: str) -> None:
  """Tells the code sandbox that a data file (and its directory) must stay
  invisible to the programs it runs (it refuses to run otherwise)."""
  if "://" in path and not path.startswith("file://"):
    return
  from fbos_jax.verifiers import sandbox  # pylint: disable=g-import-not-at-top
  local = path[len("file://"):] if path.startswith("file://") else path
  sandbox.protect_path(local)
  sandbox.protect_path(os.path.dirname(os.path.abspath(local)))


def normalize_prompt(text: str) -> str:
  """A prompt up to case and whitespace: near-duplicates map to one key."""
  return " ".join(text.casefold().split())


# ---------------------------------------------------------------------------
# The held-out split of file sources.


def _held_out_by_hash(key: str, fraction: float) -> bool:
  h = hashlib.sha256(b"fbos-eval|" + key.encode("utf-8", "surrogatepass")).digest()
  return int.from_bytes(h[:8], "big") < fraction * 2.0**64


def _check_split(cfg) -> None:
  if cfg.split not in ("train", "eval"):
    raise ValueError(f"data.split must be 'train' or 'eval': {cfg.split!r}")
  if not 0.0 <= float(cfg.eval_fraction) < 1.0:
    raise ValueError(f"data.eval_fraction must be in [0, 1): {cfg.eval_fraction!r}")


def _has_held_out(cfg) -> bool:
  return bool(cfg.get("eval_path")) or float(cfg.get("eval_fraction", 0.0)) > 0


def split_records(cfg, forbidden: tuple[str, ...] = (), stats: dict | None = None
                  ) -> tuple[list[dict], int, int]:
  """The records of ``cfg.split`` for a jsonl/parquet config.

  Args:
    cfg: the data config.
    forbidden: texts a record may not hold (see ``load_records``).
    stats: if given, receives ``near_duplicates``: training records removed
      because their prompt equals a held-out prompt up to case and whitespace
      only (not exactly).

  Returns:
    ``(records, malformed_skipped, held_out_excluded)``: for ``split="train"``
    the training records (held-out ones and ones whose prompt equals a
    held-out prompt up to case and whitespace removed, with a warning that
    counts them; ``held_out_excluded`` counts all removed), for ``"eval"``
    the held-out records only.
  """
  _check_split(cfg)
  if cfg.split == "eval" and not _has_held_out(cfg):
    raise ValueError(
        f"data.split='eval' on a {cfg.source} source needs a held-out set: set "
        "data.eval_path (a separate file) or data.eval_fraction > 0 (a hashed "
        f"share of data.path={cfg.path!r}); with neither, an eval would be "
        "scored on training records")
  if cfg.get("eval_path"):
    if cfg.split == "eval":
      records, skipped = _load_records(cfg, cfg.eval_path, forbidden)
      return _strip(records), skipped, 0
    held_out, _ = _load_records(cfg, cfg.eval_path, forbidden)
    records, skipped = _load_records(cfg, None, forbidden)
    held_keys = set()  # ids of two files may coincide: match by prompt only
  else:
    records, skipped = _load_records(cfg, None, forbidden)
    fraction = float(cfg.eval_fraction)
    if fraction <= 0:
      return _strip(records), skipped, 0
    held = [_held_out_by_hash(r["_split_key"], fraction) for r in records]
    held_out = [r for r, h in zip(records, held) if h]
    if cfg.split == "eval":
      if not held_out:
        raise ValueError(
            f"no record of data.path={cfg.path!r} ({len(records)} records) falls "
            f"in the held-out share data.eval_fraction={fraction:g}; raise it or "
            "set data.eval_path")
      return _strip(held_out), skipped, 0
    held_keys = {r["_split_key"] for r in held_out}
  held_exact = {r["prompt"] for r in held_out}
  held_near = {normalize_prompt(r["prompt"]) for r in held_out}
  train, exact, near = [], [], []
  for r in records:
    if r["_split_key"] in held_keys:
      continue  # a held-out record itself
    if r["prompt"] in held_exact:
      exact.append(r)
    elif normalize_prompt(r["prompt"]) in held_near:
      near.append(r)
    else:
      train.append(r)
  excluded = len(records) - len(train)
  if stats is not None:
    stats["near_duplicates"] = len(near)
  if not train:
    raise ValueError(f"every record of data.path={cfg.path!r} is in the held-out "
                     "set; nothing is left to train on")
  if excluded:
    logging.info("data: %d of %d records of %s are held out for eval (%s)",
                 excluded, len(records), cfg.path, describe_eval_source(cfg))
  if exact or near:
    logging.warning(
        "data: removed %d training record(s) of %s whose prompt is also a held-out "
        "prompt (%d identical, %d equal up to case and whitespace), so the eval "
        "stays held out; first: %s", len(exact) + len(near), cfg.path, len(exact),
        len(near), ", ".join(locate(r) for r in (near + exact)[:LOG_FIRST]))
  return _strip(train), skipped, excluded


def _strip(records: list[dict]) -> list[dict]:
  for r in records:
    r.pop("_split_key", None)
    r.pop("_special_text", None)
  return records


def describe_eval_source(cfg) -> str:
  """One line saying where the held-out eval examples come from (for logs)."""
  if cfg.source == "procedural":
    return (f"held-out eval: the procedural eval split of task {cfg.task!r}, "
            f"disjoint from training by content ({tasks.EVAL_PERCENT}% of "
            "problems, by a hash of the prompt, are eval-only)")
  if cfg.get("eval_path"):
    return (f"held-out eval: data.eval_path={cfg.eval_path!r}, a separate file; "
            f"training on data.path={cfg.path!r} drops any record whose prompt "
            "is in it (up to case and whitespace)")
  fraction = float(cfg.get("eval_fraction", 0.0))
  if fraction > 0:
    return (f"held-out eval: data.eval_fraction={fraction:g} of data.path="
            f"{cfg.path!r}, chosen by a hash of each record's {cfg.id_field!r} "
            "(else its prompt), and excluded from training")
  return (f"no held-out eval set: data.eval_path is empty and "
          f"data.eval_fraction=0, so training sees every record of "
          f"data.path={cfg.path!r} and there is no eval split")


# ---------------------------------------------------------------------------
# The dataset and the iterator.


class _WithVerifier:
  """grain map: sets the example's resolved ``"verifier"`` key."""

  def __init__(self, name: str):
    self.name = name

  def __call__(self, ex: dict) -> dict:
    return dict(ex, verifier=self.name)


def build_dataset(cfg, *, process_index: int, process_count: int,
                  forbidden: tuple[str, ...] = ()
                  ) -> tuple[grain.MapDataset, dict[str, int]]:
  """The host's grain ``MapDataset`` of example dicts (before length checks).

  ``forbidden``: texts a file record may not hold (see ``load_records``;
  procedural prompts are generated here and not checked).

  Returns:
    ``(dataset, counts)`` with counts ``malformed_skipped`` and
    ``held_out_excluded`` (training records left out for the eval split).
  """
  if not 0 <= process_index < process_count:
    raise ValueError(f"bad shard {process_index} of {process_count}")
  counts = {"malformed_skipped": 0, "held_out_excluded": 0, "near_duplicates": 0}
  if cfg.source == "procedural":
    _check_split(cfg)
    src = tasks.ProceduralSource(
        cfg.task, seed=cfg.generation_seed, difficulty=cfg.difficulty,
        max_difficulty=cfg.max_difficulty or None, split=cfg.split,
        num_examples=cfg.num_examples or None)
    ds = grain.MapDataset.source(src)
    # The configured verifier wins over the examples' own "procedural".
    ds = ds.map(_WithVerifier("procedural" if cfg.verifier == AUTO else cfg.verifier))
    finite = bool(cfg.num_examples)
  elif cfg.source in ("jsonl", "parquet"):
    records, counts["malformed_skipped"], counts["held_out_excluded"] = (
        split_records(cfg, forbidden, counts))
    ds = grain.MapDataset.source(records)
    finite = True
  else:
    raise ValueError(f"unknown data.source {cfg.source!r}")
  if finite:
    if cfg.shuffle:
      ds = ds.shuffle(seed=cfg.shuffle_seed)
    ds = ds.repeat(cfg.num_epochs or None)
  ds = ds[process_index::process_count]
  return ds, counts


_ORDER_FIELDS = ("source", "path", "task", "difficulty", "max_difficulty",
                 "num_examples", "generation_seed", "split", "shuffle",
                 "shuffle_seed", "num_epochs", "prompt_field", "max_prompt_chars",
                 "max_prompt_tokens", "over_long", "on_malformed")
# Fields that shape a file's training stream only when a held-out split is on
# (kept out otherwise, so the states of older runs still match).
_SPLIT_FIELDS = ("eval_path", "eval_fraction", "id_field")


def _stream_changes(cfg, counts: dict[str, int]) -> dict[str, Any]:
  """What makes this stream differ from the one an older loader built from the
  same config (issue 23): a resume across it must be refused, not silently
  read at shifted positions. Empty in the common case, so older states match."""
  extra = {}
  if cfg.get("special_text", "refuse") != "refuse":
    extra["special_text"] = cfg.special_text
  if counts.get("near_duplicates"):
    extra["eval_near_duplicates_removed"] = int(counts["near_duplicates"])
  return extra


def _fingerprint_fields(cfg, process_index: int, process_count: int,
                        batch_size: int, extra: dict | None = None) -> dict[str, Any]:
  """The fields that define which examples come in which order."""
  keys = list(_ORDER_FIELDS)
  if cfg.source != "procedural" and _has_held_out(cfg):
    keys += _SPLIT_FIELDS
  fields = {k: cfg.get(k) for k in keys}
  fields.update(extra or {})
  fields.update(process_index=process_index, process_count=process_count,
                batch_size=batch_size)
  return json.loads(json.dumps(fields, default=str))


def _fingerprint(cfg, process_index: int, process_count: int,
                 batch_size: int, extra: dict | None = None) -> str:
  keys = list(_ORDER_FIELDS)
  if cfg.source != "procedural" and _has_held_out(cfg):
    keys += _SPLIT_FIELDS
  items = [[k, cfg.get(k)] for k in keys] + [[k, v] for k, v in sorted((extra or {}).items())]
  blob = json.dumps(items + [process_index, process_count, batch_size], default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


class PromptIterator:
  """Yields host-local batches (lists of example dicts); resumable.

  Not a grain ``DatasetIterator`` itself: it wraps one, applies the
  over-long policy and batches on the host. ``get_state`` / ``set_state``
  round-trip a JSON-serializable dict.
  """

  def __init__(self, ds: grain.MapDataset, cfg, *, batch_size: int,
               fingerprint: str, malformed_skipped: int = 0, tokenizer=None,
               fingerprint_fields: dict | None = None,
               held_out_excluded: int = 0):
    if batch_size < 1:
      raise ValueError("batch_size must be >= 1")
    if cfg.over_long not in ("filter", "truncate", "error"):
      raise ValueError(f"data.over_long must be filter|truncate|error: {cfg.over_long!r}")
    if cfg.max_prompt_tokens and tokenizer is None:
      raise ValueError("data.max_prompt_tokens needs make_prompt_iterator(tokenizer=...)")
    self._ds = ds
    self._cfg = cfg
    self.batch_size = batch_size
    self._tokenizer = tokenizer
    self._fingerprint = fingerprint
    self._fingerprint_fields = dict(fingerprint_fields or {})
    self._malformed_skipped = malformed_skipped
    self._held_out_excluded = held_out_excluded
    self._counts = {"examples": 0, "batches": 0, "filtered_over_long": 0,
                    "truncated_over_long": 0}
    self._it = self._new_grain_iterator()

  def _new_grain_iterator(self):
    opts = grain.ReadOptions(num_threads=max(1, int(self._cfg.read_threads)),
                             prefetch_buffer_size=max(2, 2 * self.batch_size))
    return iter(self._ds.to_iter_dataset(opts))

  # -- over-long policy ------------------------------------------------------

  def _token_len(self, text: str) -> int:
    return len(templates.render_prompt(self._tokenizer, text))

  def _apply_length_policy(self, ex: dict) -> dict | None:
    """Returns the example (maybe truncated) or None if filtered."""
    cfg, prompt = self._cfg, ex["prompt"]
    too_long_chars = cfg.max_prompt_chars and len(prompt) > cfg.max_prompt_chars
    n_tok = self._token_len(prompt) if cfg.max_prompt_tokens else 0
    too_long_tokens = cfg.max_prompt_tokens and n_tok > cfg.max_prompt_tokens
    if not (too_long_chars or too_long_tokens):
      return ex
    what = (f"prompt has {len(prompt)} chars / {n_tok or '?'} tokens, over "
            f"data.max_prompt_chars={cfg.max_prompt_chars} / "
            f"data.max_prompt_tokens={cfg.max_prompt_tokens}")
    if cfg.over_long == "error":
      raise ValueError(f"{locate(ex)}: {what} (data.over_long='error')")
    kind = "filtered" if cfg.over_long == "filter" else "truncated"
    n = self._counts[f"{kind}_over_long"] + 1
    if n <= LOG_FIRST:
      logging.warning("data: %s over-long example %s: %s%s", kind, locate(ex), what,
                      f" (later ones are counted in data/{kind}_over_long, not "
                      "logged)" if n == LOG_FIRST else "")
    if cfg.over_long == "filter":
      self._counts["filtered_over_long"] += 1
      return None
    if too_long_chars:
      prompt = prompt[:cfg.max_prompt_chars]
    if cfg.max_prompt_tokens:
      ids = templates.encode_plain(self._tokenizer, prompt)
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
            "fields": dict(self._fingerprint_fields),
            "grain": self._it.get_state(), "counts": dict(self._counts)}

  def set_state(self, state: dict[str, Any]) -> None:
    """Restores ``get_state()`` output (from the same config and shard).

    Raises:
      ValueError: the state was saved under other order-defining fields; the
        message names each one (``data.<field>: saved X, now Y``).
    """
    if state.get("version") != STATE_VERSION:
      raise ValueError(f"unsupported data iterator state version "
                       f"{state.get('version')!r}")
    if state.get("fingerprint") != self._fingerprint:
      saved = state.get("fields")
      if saved:
        now = self._fingerprint_fields
        diff = [f"{'' if k in ('process_index', 'process_count', 'batch_size') else 'data.'}"
                f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}"
                for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        detail = "; ".join(diff) or f"fingerprint {state.get('fingerprint')}"
      else:  # a state from before the fields were recorded
        detail = (f"fingerprint saved {state.get('fingerprint')}, now "
                  f"{self._fingerprint}")
      raise ValueError(
          "data iterator state was saved with a different data config, shard "
          f"or batch size; resuming would not see the same examples ({detail})")
    self._it = self._new_grain_iterator()
    self._it.set_state(state["grain"])
    self._counts = dict(state["counts"])

  def stats(self) -> dict[str, float]:
    """Counters since the start of training (restored with the state)."""
    out = {f"data/{k}": float(v) for k, v in self._counts.items()}
    out["data/malformed_skipped"] = float(self._malformed_skipped)
    out["data/held_out_excluded"] = float(self._held_out_excluded)
    return out


def make_prompt_iterator(
    data_config: ml_collections.ConfigDict,
    *,
    batch_size: int,
    process_index: int | None = None,
    process_count: int | None = None,
    seed: int | None = None,
    tokenizer=None,
    templates_config: ml_collections.ConfigDict | None = None,
) -> PromptIterator:
  """Builds this host's resumable iterator of prompt batches.

  Args:
    data_config: ``default_data_config()`` or an override of it.
    batch_size: examples per host-local batch (prompts, before the group of
      n rollouts per prompt).
    process_index / process_count: this host's shard; default
      ``jax.process_index()`` / ``jax.process_count()``.
    seed: overrides ``data_config.shuffle_seed`` when given.
    tokenizer: needed for ``max_prompt_tokens``, and for the special-text
      check: with it, a file record whose text holds one of
      ``templates.forbidden_texts(tokenizer, templates_config)`` is refused
      at load, naming file:line (``data.special_text``).
    templates_config: ``config.templates`` (its markers); default: the
      default templates of the style the tokenizer goes with.

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
  forbidden = ()
  if tokenizer is not None:
    if templates_config is None:
      templates_config = templates.inferred_template_config(tokenizer)
    forbidden = templates.forbidden_texts(tokenizer, templates_config)
  elif templates_config is not None:
    forbidden = templates.forbidden_texts(None, templates_config)
  ds, counts = build_dataset(cfg, process_index=process_index,
                             process_count=process_count, forbidden=forbidden)
  return PromptIterator(
      ds, cfg, batch_size=batch_size, tokenizer=tokenizer,
      malformed_skipped=counts["malformed_skipped"],
      held_out_excluded=counts["held_out_excluded"],
      fingerprint=_fingerprint(cfg, process_index, process_count, batch_size,
                               _stream_changes(cfg, counts)),
      fingerprint_fields=_fingerprint_fields(cfg, process_index, process_count,
                                             batch_size, _stream_changes(cfg, counts)))


def held_out_examples(data_config, num_prompts: int, *, process_index: int = 0,
                      process_count: int = 1, tokenizer=None, templates_config=None,
                      skip: int = 0) -> list:
  """This host's share of the fixed held-out set (the eval split, unshuffled):
  ``num_prompts`` (``train.eval_prompts``) examples in all. With ``tokenizer``
  (and ``templates_config``) its records get the load-time text checks of
  :func:`make_prompt_iterator`.

  A procedural held-out set holds ``train.eval_prompts`` *distinct* problems:
  drawing by index repeats the problems of a small part of the space (the 1-digit
  sums' eval split has 9 problems, which made up 116 of 256 draws), and one
  problem counted dozens of times swamps the accuracy. Every host builds the same
  list and takes an equal slice of it.

  ``skip`` > 0 (procedural tasks): the next ``num_prompts`` distinct problems of
  the eval split after its first ``skip``, none of them in the set of ``skip``
  (a validation split beside the test set: ``skip=train.eval_prompts``)."""
  n = int(num_prompts)
  if n <= 0:
    return []
  dc = default_data_config()
  dc.update(data_config.to_dict())
  dc.split = "eval"
  dc.shuffle = False
  dc.num_epochs = 1
  dc.drop_remainder = False  # a held-out split smaller than the batch is still used
  if skip and dc.source != "procedural":
    raise ValueError(f"a validation split (skip={skip}) of data.source={dc.source!r}: only "
                     "procedural tasks have one (their eval split is open-ended)")
  if dc.source == "procedural":
    want = n + int(skip)
    dc.num_examples = 8 * want
    unique: dict = {}
    for batch in make_prompt_iterator(dc, batch_size=n, process_index=0, process_count=1,
                                      tokenizer=tokenizer, templates_config=templates_config):
      for ex in batch:
        unique.setdefault(ex["prompt"], ex)
      if len(unique) >= want:
        break
    examples = list(unique.values())[skip:want]
    if len(examples) < n:
      logging.warning("held-out set: %d distinct problems (train.eval_prompts=%d, skip=%d); "
                      "the task's eval split is smaller", len(examples), n, skip)
    share = len(examples) // process_count
    return examples[process_index * share:(process_index + 1) * share]
  it = make_prompt_iterator(dc, batch_size=max(n // process_count, 1),
                            process_index=process_index, process_count=process_count,
                            tokenizer=tokenizer, templates_config=templates_config)
  try:
    return list(next(it))
  except StopIteration:
    return []
