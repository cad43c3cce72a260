"""Tests for the grain data pipeline (fbos_jax.data)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fbos_jax import data
from fbos_jax import tokenizer as tk


def write_jsonl(path, n, bad_lines=(), extra=None):
  with open(path, "w") as f:
    for i in range(1, n + 1):  # i is the 1-based line number
      if i in bad_lines:
        f.write('{"prompt": "broken",\n')
      else:
        f.write(json.dumps({"prompt": f"q{i}=", "answer": str(i),
                            **(extra or {})}) + "\n")
  return str(path)


def jsonl_config(path, **kw):
  """A jsonl config whose training stream is the whole file: no held-out
  share (tests/test_reliability_data.py covers it), and a verifier that needs
  no answer field, so that every record here is well-formed."""
  cfg = data.default_data_config()
  cfg.source = "jsonl"
  cfg.path = str(path)
  cfg.eval_fraction = 0.0
  cfg.verifier = "ifeval"
  cfg.update(kw)
  return cfg


def take(it, n):
  out = []
  while len(out) < n:
    out.extend(next(it))
  return out[:n]


def ids(examples):
  return [e["id"] for e in examples]


def test_malformed_line_17_error_names_file_and_line(tmp_path):
  path = write_jsonl(tmp_path / "train.jsonl", 30, bad_lines={17})
  with pytest.raises(data.MalformedRecordError) as e:
    data.make_prompt_iterator(jsonl_config(path), batch_size=4,
                              process_index=0, process_count=1)
  assert f"{path}:17:" in str(e.value)
  assert "malformed JSON" in str(e.value)


def test_malformed_lines_skipped_with_count(tmp_path):
  path = write_jsonl(tmp_path / "train.jsonl", 30, bad_lines={17, 21})
  cfg = jsonl_config(path, on_malformed="skip", num_epochs=1, shuffle=False,
                     drop_remainder=False)
  it = data.make_prompt_iterator(cfg, batch_size=4, process_index=0,
                                 process_count=1)
  got = [ex for batch in it for ex in batch]
  assert len(got) == 28
  assert "train.jsonl:17" not in ids(got) and "train.jsonl:18" in ids(got)
  assert it.stats()["data/malformed_skipped"] == 2


def test_missing_prompt_field_is_malformed(tmp_path):
  path = tmp_path / "x.jsonl"
  path.write_text('{"prompt": "a"}\n[1, 2]\n{"question": "b"}\n')
  with pytest.raises(data.MalformedRecordError, match=r"x.jsonl:2: expected a JSON object"):
    data.load_records(jsonl_config(path))
  recs, skipped = data.load_records(jsonl_config(path, on_malformed="skip"))
  assert skipped == 2 and [r["prompt"] for r in recs] == ["a"]
  recs, _ = data.load_records(jsonl_config(path, prompt_field="question",
                                           on_malformed="skip"))
  assert [r["prompt"] for r in recs] == ["b"]


@pytest.mark.parametrize("source", ["jsonl", "procedural"])
def test_resume_gives_identical_next_100_examples(tmp_path, source):
  if source == "jsonl":
    cfg = jsonl_config(write_jsonl(tmp_path / "d.jsonl", 37), shuffle_seed=5)
  else:
    cfg = data.default_data_config()
    cfg.task = "arithmetic,sort"
    cfg.difficulty = 2
  make = lambda: data.make_prompt_iterator(cfg, batch_size=6, process_index=1,
                                           process_count=2)
  it = make()
  for _ in range(9):  # part-way into the second epoch of the 37/2 shard
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # survives serialization
  expected = take(it, 100)
  resumed = make()
  resumed.set_state(state)
  assert take(resumed, 100) == expected
  assert resumed.stats()["data/batches"] >= 9 + 100 // 6


def test_state_from_another_config_is_refused(tmp_path):
  cfg = jsonl_config(write_jsonl(tmp_path / "d.jsonl", 20))
  it = data.make_prompt_iterator(cfg, batch_size=4, process_index=0,
                                 process_count=1)
  next(it)
  other = data.make_prompt_iterator(cfg, batch_size=4, process_index=0,
                                    process_count=1, seed=99)
  with pytest.raises(ValueError, match="different data config"):
    other.set_state(it.get_state())


@pytest.mark.parametrize("n", [40, 41])
def test_two_hosts_get_disjoint_shards_covering_the_data(tmp_path, n):
  cfg = jsonl_config(write_jsonl(tmp_path / "d.jsonl", n), num_epochs=1,
                     drop_remainder=False)
  shards = []
  for p in range(2):
    it = data.make_prompt_iterator(cfg, batch_size=3, process_index=p,
                                   process_count=2)
    shards.append(ids(ex for batch in it for ex in batch))
  assert not set(shards[0]) & set(shards[1])
  assert sorted(shards[0] + shards[1]) == sorted(f"d.jsonl:{i}" for i in range(1, n + 1))
  assert abs(len(shards[0]) - len(shards[1])) <= 1


def test_procedural_hosts_disjoint():
  cfg = data.default_data_config()
  streams = [ids(take(data.make_prompt_iterator(
      cfg, batch_size=5, process_index=p, process_count=2), 50)) for p in range(2)]
  assert not set(streams[0]) & set(streams[1])


def test_shuffle_is_seeded_and_epochs_are_permutations(tmp_path):
  cfg = jsonl_config(write_jsonl(tmp_path / "d.jsonl", 12), num_epochs=2,
                     drop_remainder=False)
  run = lambda seed: ids(ex for b in data.make_prompt_iterator(
      cfg, batch_size=5, process_index=0, process_count=1, seed=seed) for ex in b)
  a, b, c = run(1), run(1), run(2)
  assert a == b and a != c
  assert len(a) == 24
  assert sorted(a[:12]) == sorted(a[12:]) and a[:12] != a[12:]
  assert sorted(a[:12]) != a[:12]  # shuffled


def test_over_long_prompts_filter_truncate_error(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text("".join(json.dumps({"prompt": "x" * n}) + "\n"
                          for n in (3, 12, 5, 30, 4)))
  run = lambda **kw: data.make_prompt_iterator(
      jsonl_config(path, num_epochs=1, shuffle=False, drop_remainder=False,
                   max_prompt_chars=8, **kw), batch_size=10, process_index=0,
      process_count=1)
  it = run(over_long="filter")
  assert [len(e["prompt"]) for e in next(it)] == [3, 5, 4]
  assert it.stats()["data/filtered_over_long"] == 2
  it = run(over_long="truncate")
  batch = next(it)
  assert [len(e["prompt"]) for e in batch] == [3, 8, 5, 8, 4]
  assert it.stats()["data/truncated_over_long"] == 2
  with pytest.raises(ValueError, match="over data.max_prompt_chars=8"):
    next(run(over_long="error"))


def test_over_long_by_tokens_uses_the_chat_template(tmp_path):
  tok = tk.load_tokenizer(tk.build_char_tokenizer(tmp_path / "tok"))
  tok.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
  path = tmp_path / "d.jsonl"
  path.write_text("".join(json.dumps({"prompt": "y" * n}) + "\n" for n in (4, 9)))
  cfg = jsonl_config(path, num_epochs=1, shuffle=False, drop_remainder=False,
                     max_prompt_tokens=8, over_long="truncate")
  batch = next(data.make_prompt_iterator(cfg, batch_size=4, process_index=0,
                                         process_count=1, tokenizer=tok))
  assert [e["prompt"] for e in batch] == ["y" * 4, "y" * 6]  # "[" + 6 + "]" = 8
  with pytest.raises(ValueError, match="tokenizer"):
    data.make_prompt_iterator(cfg, batch_size=4, process_index=0, process_count=1)


def test_parquet_and_fsspec_paths(tmp_path):
  table = pa.table({"question": [f"p{i}" for i in range(10)],
                    "answer": [str(i) for i in range(10)],
                    "id": [f"row{i}" for i in range(10)]})
  pq.write_table(table.slice(0, 6), tmp_path / "a.parquet")
  pq.write_table(table.slice(6, 4), tmp_path / "b.parquet")
  cfg = data.default_data_config()
  cfg.update(dict(source="parquet", path=f"file://{tmp_path}/*.parquet",
                  prompt_field="question", num_epochs=1, shuffle=False,
                  drop_remainder=False, verifier="math", eval_fraction=0.0))
  got = [e for b in data.make_prompt_iterator(cfg, batch_size=4, process_index=0,
                                              process_count=1) for e in b]
  assert [e["id"] for e in got] == [f"row{i}" for i in range(10)]
  assert got[3]["prompt"] == "p3" and got[3]["answer"] == "3"
  assert {e["verifier"] for e in got} == {"math"}  # the configured verifier

  import fsspec  # pylint: disable=g-import-not-at-top
  with fsspec.open("memory://fbos_test/d.jsonl", "w") as f:
    f.write('{"prompt": "m1"}\n{"prompt": "m2"}\n')
  recs, _ = data.load_records(jsonl_config("memory://fbos_test/d.jsonl"))
  assert [r["prompt"] for r in recs] == ["m1", "m2"]
  with pytest.raises(FileNotFoundError):
    data.expand_paths(str(tmp_path / "none*.jsonl"))


def test_procedural_eval_split_is_disjoint_from_train():
  cfg = data.default_data_config()
  cfg.difficulty = 2
  train = {e["prompt"] for e in take(data.make_prompt_iterator(
      cfg, batch_size=50, process_index=0, process_count=1), 500)}
  cfg.split = "eval"
  evals = take(data.make_prompt_iterator(cfg, batch_size=50, process_index=0,
                                         process_count=1), 100)
  assert all(e["split"] == "eval" for e in evals)
  assert not train & {e["prompt"] for e in evals}


@pytest.mark.parametrize("task, difficulty", [("chain", 4), ("sort", 4)])
def test_the_validation_split_is_new_problems_and_leaves_the_test_set_unchanged(task, difficulty):
  """The learning-rate sweep's split (issue 33): the next distinct problems of the
  eval split after the test set's, so a rate is never picked on the test set."""
  cfg = data.default_data_config()
  cfg.source, cfg.task, cfg.difficulty, cfg.max_difficulty = "procedural", task, difficulty, difficulty
  test = data.held_out_examples(cfg, 64)
  valid = data.held_out_examples(cfg, 64, skip=64)
  assert len(valid) == 64 == len({e["prompt"] for e in valid})
  assert not {e["prompt"] for e in test} & {e["prompt"] for e in valid}
  both = [e["prompt"] for e in data.held_out_examples(cfg, 128)]
  assert both == [e["prompt"] for e in test + valid]  # the test set as it was, then new ones
  cfg2 = data.default_data_config()
  cfg2.source, cfg2.path = "jsonl", "/nonexistent.jsonl"
  with pytest.raises(ValueError, match="validation split .* only procedural"):
    data.held_out_examples(cfg2, 8, skip=8)


def test_finite_procedural_source_shuffles_and_ends():
  cfg = data.default_data_config()
  cfg.update(dict(num_examples=10, num_epochs=1, drop_remainder=True))
  it = data.make_prompt_iterator(cfg, batch_size=4, process_index=0, process_count=1)
  batches = list(it)
  assert [len(b) for b in batches] == [4, 4]  # the partial third is dropped
  assert len({e["id"] for b in batches for e in b}) == 8
