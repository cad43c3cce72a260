"""No module of fbos_jax/ uses another package's ``_private`` name (issue 35):
neither ``from x import _y`` nor ``x._y`` where ``x`` was imported from a module
of another package (fbos_jax's or fbos_kernels'). Within one package (the
modules of one directory) a private helper may be shared."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT = ("fbos_jax", "fbos_kernels")

def _modules(root: str) -> dict:
  """{dotted module name: (path, is a package)} of fbos_jax/ and kernels/fbos_kernels/."""
  out = {}
  for top, prefix in (("fbos_jax", ""), (os.path.join("kernels", "fbos_kernels"), "kernels")):
    for d, _, files in os.walk(os.path.join(root, top)):
      for f in files:
        if f.endswith(".py"):
          path = os.path.join(d, f)
          parts = os.path.relpath(path, os.path.join(root, prefix))[:-3].split(os.sep)
          is_pkg = parts[-1] == "__init__"
          out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
  return out


def private_uses_across_packages(root: str) -> set:
  """Every use by a module of ``root``/fbos_jax of another package's private name,
  as "importer -> module.name"."""
  mods = _modules(root)
  package = lambda m: m if m in mods and mods[m][1] else m.rpartition(".")[0]
  private = lambda n: n.startswith("_") and not n.startswith("__")
  found = set()
  for me, (path, is_pkg) in mods.items():
    if not me.startswith("fbos_jax"):
      continue
    with open(path) as f:
      tree = ast.parse(f.read())
    bound = {}  # a local name -> the project module it names, or the module it came from

    def note(target, name):
      if package(target) != package(me) and target != me:
        found.add(f"{me} -> {target}.{name}")

    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom):
        src = node.module or ""
        if node.level:  # relative: from the importer's package up
          base = me if is_pkg else me.rpartition(".")[0]
          for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
          src = f"{base}.{src}" if src else base
        if src.split(".")[0] not in PROJECT:
          continue
        for a in node.names:
          target = f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src
          if private(a.name):
            note(src, a.name)
          bound[a.asname or a.name] = target
      elif isinstance(node, ast.Import):
        for a in node.names:
          if a.name.split(".")[0] in PROJECT:
            top = a.name.split(".")[0]
            bound[a.asname or top] = a.name if a.asname else top
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and private(node.attr)
          and isinstance(node.value, ast.Name) and node.value.id in bound):
        note(bound[node.value.id], node.attr)
  return found


def test_the_check_finds_a_private_name_used_across_packages(tmp_path):
  files = {"fbos_jax/__init__.py": "",
           "fbos_jax/a/__init__.py": "",
           "fbos_jax/a/x.py": "def _h(): pass\n",
           "fbos_jax/a/y.py": "from fbos_jax.a import x\nfrom fbos_jax.a.x import _h\nx._h()\n",
           "fbos_jax/b/__init__.py": "",
           "fbos_jax/b/z.py": ("from fbos_jax.a import x as xl\nfrom fbos_jax.a.x import _h\n"
                               "from fbos_jax.a.y import x\nxl._h(); x.__name__\n"),
           "kernels/fbos_kernels/__init__.py": "_k = 1\n",
           "fbos_jax/c.py": "import fbos_kernels\nfbos_kernels._k\n"}
  for name, text in files.items():
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(text)
  assert private_uses_across_packages(str(tmp_path)) == {
      "fbos_jax.b.z -> fbos_jax.a.x._h", "fbos_jax.c -> fbos_kernels._k"}


def test_no_private_name_is_used_across_packages():
  found = private_uses_across_packages(ROOT)
  assert not found, "private names used across packages:\n" + "\n".join(sorted(found))
