"""docs/architecture.md against the code, read as text (no JAX, no imports of the package).

* every repository path the page names (``fbos_jax/rl/trainer.py``,
  ``kernels/fbos_kernels/``, ``configs/fbos.py:qwen_8b``) exists;
* every module of the step's packages (``fbos_jax/rl/``, ``fbos_jax/sampling/``,
  ``fbos_jax/engine/``, ``fbos_jax/planning/``) is named on the page by its path;
* every module of the package that ``launch/train.py`` reaches through its import
  statements (followed transitively, the imports inside functions included) is
  named on the page by its path, or its package by its folder.

A new, moved or renamed module fails here until the page says where it lives.
"""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "architecture.md")
PACKAGES = ("rl", "sampling", "engine", "planning")
# a repository path in the page's text: a top-level folder, then path characters
PATH = re.compile(r"(?<![\w/.-])((?:fbos_jax|kernels|launch|configs|tests|docs)/[\w/.-]*[\w/])")


def _page() -> str:
  with open(PAGE, encoding="utf-8") as f:
    return f.read()


def named_paths(text: str) -> set:
  """The repository paths ``text`` names (a ``:variant`` or ``:function`` suffix dropped)."""
  return {m.group(1) for m in PATH.finditer(text)}


def test_every_named_path_exists():
  missing = sorted(p for p in named_paths(_page()) if not os.path.exists(os.path.join(ROOT, p)))
  assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def _modules(package: str) -> list:
  folder = os.path.join(ROOT, "fbos_jax", package)
  return sorted(f"fbos_jax/{package}/{f}" for f in os.listdir(folder)
                if f.endswith(".py") and f != "__init__.py")


def test_every_module_of_the_step_packages_is_named():
  text = _page()
  missing = [m for pkg in PACKAGES for m in _modules(pkg) if not _named(m, text)]
  assert not missing, f"docs/architecture.md does not name these modules: {missing}"


def _module_file(dotted: str):
  """The file of module ``dotted`` in this repository (None: a name, not a module)."""
  base = os.path.join(ROOT, *dotted.split("."))
  for path in (base + ".py", os.path.join(base, "__init__.py")):
    if os.path.isfile(path):
      return os.path.relpath(path, ROOT)
  return None


def package_imports(path: str) -> set:
  """The ``fbos_jax`` modules the file at ``path`` (repository-relative) imports,
  anywhere in it (``from fbos_jax.rl import trainer`` names module ``fbos_jax.rl.trainer``)."""
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    tree = ast.parse(f.read())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
  return {f for f in map(_module_file, (n for n in names if n.split(".")[0] == "fbos_jax"))
          if f is not None}


def reachable(start: str) -> set:
  """Every file reached from ``start`` through the package's import statements."""
  seen, todo = set(), [start]
  while todo:
    path = todo.pop()
    if path not in seen:
      seen.add(path)
      todo += package_imports(path)
  return seen


def _named(path: str, text: str) -> bool:
  """Whether ``text`` names the file ``path`` (a package's ``__init__.py``: its folder
  or any path in it)."""
  named = named_paths(text)
  if path.endswith("/__init__.py"):
    return any(p.startswith(path[:-len("__init__.py")]) for p in named)
  return path in named


def test_every_module_the_launcher_reaches_is_named():
  files = reachable("launch/train.py")
  assert "fbos_jax/engine/runner.py" in files and "fbos_jax/rl/trainer.py" in files  # the walk works
  text = _page()
  missing = sorted(f for f in files if f.startswith("fbos_jax/") and f != "fbos_jax/__init__.py"
                   and not _named(f, text))
  assert not missing, f"docs/architecture.md does not name these modules of a run: {missing}"


def test_the_checks_can_fail():
  """The path pattern finds what the checks need, and a missing module is caught."""
  assert named_paths("see `fbos_jax/rl/trainer.py:RLTrainer` and kernels/fbos_kernels/.") == {
      "fbos_jax/rl/trainer.py", "kernels/fbos_kernels/"}
  assert not os.path.exists(os.path.join(ROOT, "fbos_jax/rl/no_such_module.py"))
  assert not _named("fbos_jax/rl/batch.py", "the table `fbos_jax/rl/batch_kinds.py`")
  assert _named("fbos_jax/engine/__init__.py", "the engine (`fbos_jax/engine/`)")
