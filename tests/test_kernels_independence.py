"""kernels/ depends on jax alone: no flax, transformers, torch or fbos_jax (checked at runtime and statically)."""

import ast
import os
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "kernels")
PKG = os.path.join(KERNELS, "fbos_kernels")
FORBIDDEN = {"flax", "transformers", "fbos_jax", "torch", "optax", "orbax", "tensorflow", "numpy_ml"}
# everything the package may import: jax and the standard library
ALLOWED = {"jax", "jaxlib", "__future__", "functools", "typing", "math", "dataclasses", "collections"}


def test_runtime_imports_only_jax():
  code = (
      "import sys\n"
      "import fbos_kernels as K\n"
      # function-level imports are excluded by the static scan below (it walks the whole AST)
      "import fbos_kernels.advantages, fbos_kernels.gfpo, fbos_kernels.losses, fbos_kernels.aggregation\n"
      "import fbos_kernels.logprobs\n"
      f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FORBIDDEN)!r})\n"
      "assert not bad, bad\n"
      "assert K.__file__.startswith(sys.argv[1]), K.__file__\n"
      "print('OK')\n"
  )
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["PYTHONPATH"] = KERNELS  # only the kernels package: the repo root (fbos_jax) is not importable
  env["JAX_PLATFORMS"] = "cpu"
  out = subprocess.run([sys.executable, "-c", code, PKG], capture_output=True, text=True, env=env,
                       cwd=KERNELS, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip().endswith("OK")


def _imports(path):
  tree = ast.parse(open(path).read(), path)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        yield a.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom):
      if node.level == 0:
        yield node.module.split(".")[0]
    elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
      yield "__import__"  # dynamic imports are not allowed either


def test_static_scan_of_sources():
  files = [os.path.join(dp, f) for dp, _, fs in os.walk(PKG) for f in fs if f.endswith(".py")]
  assert len(files) >= 6
  seen = set()
  for f in files:
    mods = set(_imports(f))
    assert not mods & FORBIDDEN, (f, mods & FORBIDDEN)
    assert mods <= ALLOWED, (f, mods - ALLOWED)
    src = open(f).read()
    for name in FORBIDDEN:
      assert f"import {name}" not in src and f"from {name}" not in src, (f, name)
    seen |= mods
  assert "jax" in seen


def test_pyproject_declares_jax_only():
  meta = tomllib.load(open(os.path.join(KERNELS, "pyproject.toml"), "rb"))
  assert meta["project"]["name"] == "fbos-kernels"
  deps = meta["project"]["dependencies"]
  assert [d.split(">")[0].split("=")[0].split("<")[0].strip() for d in deps] == ["jax"]
  assert meta["tool"]["setuptools"]["packages"] == ["fbos_kernels"]
