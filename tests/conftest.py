"""Test session setup: 8 fake CPU devices, and the in-repo kernels package on sys.path."""
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# libtpu (the TPU compiler for topology tests) takes a process lock unless told not to
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_STDERR_LOG_LEVEL", "3")
os.environ.setdefault("TPU_MIN_LOG_LEVEL", "3")
# A persistent compilation cache outside the clone (compiling is most of the suite's
# time): a second run of the suite, or another test with the same program, loads it.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fbos_jax", "jax_tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (_ROOT, os.path.join(_ROOT, "kernels")):
  if p not in sys.path:
    sys.path.insert(0, p)
