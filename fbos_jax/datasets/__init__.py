"""Small datasets that live in the repository (generator + its committed output).

* :mod:`fbos_jax.datasets.arith_word`: arithmetic word problems (one or two
  operations, small numbers) with worked solutions in GSM8K (``#### 42``) and
  MATH (``\\boxed{42}``) form; ``train.jsonl`` / ``test.jsonl`` for
  ``config.data.source = "jsonl"`` and the ``math`` verifier.
"""
