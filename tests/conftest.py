"""Test session setup: 8 fake CPU devices, an opt-in persistent compilation cache, and the
fixtures tests share (the project is installed in editable mode: nothing here
touches sys.path)."""
import os

import pytest

# 8 fake CPU devices; LLVM at -O0 without its expensive passes: the suite's programs are
# tiny and compiling them is most of its time (43% less CPU on tests/test_update_step.py;
# float semantics do not change)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                      "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# libtpu (the TPU compiler for topology tests) takes a process lock unless told not to
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_STDERR_LOG_LEVEL", "3")
os.environ.setdefault("TPU_MIN_LOG_LEVEL", "3")
# A persistent compilation cache, opt-in (FBOS_TEST_COMPILE_CACHE=1): a second run of the
# suite then loads its compiled programs from ~/.cache/fbos_jax/jax_tests. Off by default
# (so in CI): XLA's CPU executable serialize() segfaulted writing update programs in CI's
# xdist workers (tests/test_sft.py, the compile set), twice in two clean-clone runs, and a
# cold clone gains little from it. A size bound turns on the cache's file lock around every
# read and write, so a worker never reads an entry another one is writing.
if os.environ.get("FBOS_TEST_COMPILE_CACHE") == "1":
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fbos_jax", "jax_tests"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))


@pytest.fixture
def small():
  """``small(spec, **{"dotted.field": value})``: the tiny config shrunk for tests
  (``fbos_jax.testing.small.small_config``)."""
  from fbos_jax.testing.small import small_config
  return small_config


@pytest.fixture
def one_device_mesh():
  """A mesh over the first device."""
  from fbos_jax.testing.small import one_device_mesh as mesh
  return mesh()


def pytest_pyfunc_call(pyfuncitem):
  """A test marked ``isolated`` runs in a fresh interpreter (``pytest -n 0 NODEID``), its
  output shown when it fails. For the SFT update's compiles: XLA's CPU compiler
  segfaulted compiling them inside CI's xdist workers after other test files had run
  there (tests/test_sft.py, in three clean-clone runs; never in a process of its own,
  and a segfault takes the whole worker and xdist's run with it)."""
  if pyfuncitem.get_closest_marker("isolated") is None or os.environ.get("FBOS_ISOLATED_CHILD"):
    return None
  import subprocess
  import sys
  env = dict(os.environ, FBOS_ISOLATED_CHILD="1")
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "--durations=0",
                      "-m", "", pyfuncitem.nodeid],  # -m "": a slow test is not deselected
                     cwd=str(pyfuncitem.config.rootpath), env=env,
                     capture_output=True, text=True)
  if r.returncode != 0:
    pytest.fail(f"{pyfuncitem.nodeid} failed in its own process (exit {r.returncode}):\n"
                f"{r.stdout[-8000:]}\n{r.stderr[-4000:]}", pytrace=False)
  return True


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_after_each_file():
  """A worker runs many files (xdist's loadfile): drop each file's compiled programs
  when it ends, so a worker's memory stays that of one file (a worker grew to 6.7 GB
  over the suite, and XLA's compiler aborted or segfaulted in CI workers near its end)."""
  yield
  import gc
  import sys
  if "jax" in sys.modules:
    sys.modules["jax"].clear_caches()
  gc.collect()
