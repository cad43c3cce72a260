"""Reliability probes of the code sandbox (issue 14, item 7): a "solution" must
not read the host's files (dataset, repository, home, /etc), and a host without
namespaces must refuse to run code rather than run it unconfined."""

import os
import shutil
import tempfile

import pytest

from fbos_jax.verifiers import get_verifier
from fbos_jax.verifiers import sandbox as sandbox_lib
from fbos_jax.verifiers.sandbox import Sandbox
from fbos_jax.verifiers.sandbox import SandboxError
from fbos_jax.verifiers.sandbox import SandboxLimits

LIMITS = SandboxLimits(wall_s=3, cpu_s=2, memory_mb=256, max_processes=16)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = """
import os, sys
for p in sys.argv[1:] or {paths!r}:
    try:
        with open(p) as f:
            print("LEAK", p, repr(f.read(40)))
    except OSError as e:
        print("DENIED", p, type(e).__name__)
for d in {dirs!r}:
    try:
        print("LIST", d, sorted(os.listdir(d))[:5])
    except OSError as e:
        print("DENIED", d, type(e).__name__)
"""


@pytest.fixture(scope="module")
def sandbox():
  sb = Sandbox(LIMITS)
  if not sb.capabilities()["namespaces"]:
    pytest.skip("this host has no namespaces; the refusal test covers it")
  return sb


@pytest.fixture
def host_dir():
  """A world-readable directory under /tmp (only the sandbox may stop a read)."""
  d = tempfile.mkdtemp(prefix="fbos_host_", dir="/tmp")
  os.chmod(d, 0o755)
  yield d
  shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def home_secret():
  fd, path = tempfile.mkstemp(prefix="fbos_sbx_probe_", dir=os.path.expanduser("~"))
  os.write(fd, b"home secret")
  os.close(fd)
  os.chmod(path, 0o644)
  yield path
  os.remove(path)


def test_solution_cannot_read_host_files(sandbox, host_dir, home_secret):
  dataset = os.path.join(host_dir, "train.jsonl")
  with open(dataset, "w") as f:
    f.write('{"prompt": "p", "answer": "dataset secret"}\n')
  os.chmod(dataset, 0o644)
  paths = [str(dataset), os.path.join(REPO, "README.md"), home_secret, "/etc/passwd",
           "/etc/hostname", os.path.abspath(sandbox_lib.__file__)]
  r = sandbox.run(_PROBE.format(paths=paths, dirs=["/root", REPO, host_dir]))
  assert r.status == "ok", r
  assert "LEAK" not in r.stdout, r.stdout
  for p in paths:
    assert f"DENIED {p}" in r.stdout
  listed = [line for line in r.stdout.splitlines() if line.startswith("LIST /root")]
  for line in listed:  # at most the interpreter's own tree shows through
    assert os.path.basename(home_secret) not in line
  # The run can still use its interpreter, the standard library and its cwd.
  r = sandbox.run("import json, heapq, subprocess\nopen('x.txt', 'w').write('1')\n"
                  "print(open('x.txt').read(), subprocess.run(['echo', 'hi'], "
                  "capture_output=True, text=True).stdout.strip())")
  assert r.stdout.split() == ["1", "hi"], r


MAGIC = "the expected output " + "91827"  # split: the line below holds it whole
EXPECTED_LINE = "the expected output 91827"


def test_code_verifier_rewards_no_solution_that_finds_its_own_test(sandbox):
  tests = [{"input": "", "output": MAGIC}]
  # The "solution" opens this test file (world-readable, in the repository),
  # finds the expected output and prints it.
  cheat = ("import re\n"
           f"src = open({os.path.abspath(__file__)!r}).read()\n"
           "print(re.search(r'EXPECTED_LINE = \"(.*)\"', src).group(1))\n")
  verify = get_verifier("code", wall_s=3, cpu_s=2, sandbox=sandbox)
  v = verify({"tests": tests}, cheat)
  assert v.reward == 0.0
  assert "FileNotFoundError" in v.feedback or "PermissionError" in v.feedback


def test_without_namespaces_the_sandbox_refuses_to_run(monkeypatch):
  monkeypatch.setattr(sandbox_lib.shutil, "which", lambda name: None)
  sb = Sandbox(LIMITS)  # the default isolation: namespaces or nothing
  with pytest.raises(SandboxError, match="namespaces"):
    sb.run("print('unconfined')")
  v = get_verifier("code", sandbox=sb)({"tests": [{"input": "", "output": "x"}]},
                                       "print('x')")
  assert v.reward == 0.0 and v.is_error
  assert "namespaces" in v.error and v.feedback == ""
  # Running unconfined is an explicit choice.
  unconfined = Sandbox(LIMITS, isolation="none")
  assert unconfined.run("print('ok')").stdout.strip() == "ok"


# ---------------------------------------------------------------- round two (issue 23)


@pytest.fixture
def protected(monkeypatch):
  """A clean registry of protected paths (restored afterwards)."""
  monkeypatch.setattr(sandbox_lib, "_protected", set())
  monkeypatch.setenv(sandbox_lib.PROTECTED_ENV, "")
  return sandbox_lib


@pytest.fixture
def usr_dataset():
  """A dataset under /usr/local/share (as Docker images put data under /usr)."""
  d = tempfile.mkdtemp(prefix="fbos_probe_", dir="/usr/local/share")
  os.chmod(d, 0o755)
  path = os.path.join(d, "train.jsonl")
  with open(path, "w") as f:
    f.write('{"prompt": "p", "answer": "usr secret", "tests": []}\n')
  os.chmod(path, 0o644)
  yield path
  shutil.rmtree(d, ignore_errors=True)


def test_dataset_under_usr_is_invisible_and_usr_is_not_exposed(sandbox, usr_dataset):
  r = sandbox.run(_PROBE.format(paths=[usr_dataset], dirs=["/usr", "/usr/local"]))
  assert r.status == "ok", r
  assert "LEAK" not in r.stdout and f"DENIED {usr_dataset}" in r.stdout, r.stdout
  r = sandbox.run("import os\nprint(sorted(os.listdir('/usr')))\n"
                  "print([p for p in ('/usr/share', '/usr/local', '/usr/include', '/usr/src', "
                  "'/usr/sbin') if os.path.exists(p)])")
  listing, present = r.stdout.splitlines()
  assert "share" not in listing and "local" not in listing, listing
  assert present == "[]", present
  # The code verifier: a "solution" that reads its own dataset under /usr gets nothing.
  cheat = f"print(open({usr_dataset!r}).read().split('usr secret')[0] and 'usr secret')"
  v = get_verifier("code", wall_s=3, cpu_s=2, sandbox=sandbox)(
      {"tests": [{"input": "", "output": "usr secret"}]}, cheat)
  assert v.reward == 0.0 and "FileNotFoundError" in v.feedback


def test_sandbox_fails_closed_when_a_protected_path_would_be_visible(protected, tmp_path):
  stdlib = os.path.dirname(os.__file__)  # exposed: the interpreter needs it
  inside = os.path.join(stdlib, "fbos_dataset.jsonl")
  protected.protect_path(inside)
  sb = Sandbox(LIMITS)
  with pytest.raises(SandboxError, match="fbos_dataset.jsonl") as e:
    sb.run("print('ran')")
  assert "protected" in str(e.value)
  # The data loader declares its files (and their directory), the console the workdir.
  from fbos_jax import console
  from fbos_jax import data
  protected._protected.clear()
  os.environ[protected.PROTECTED_ENV] = ""
  ds = tmp_path / "d" / "train.jsonl"
  ds.parent.mkdir()
  ds.write_text('{"prompt": "p", "answer": "1"}\n')
  cfg = data.default_data_config()
  cfg.update(dict(source="jsonl", path=str(ds), verifier="math"))
  data.load_records(cfg)
  console.setup_logging(str(tmp_path / "workdir"))
  console.teardown_logging()
  assert {str(ds), str(ds.parent), str(tmp_path / "workdir")} <= set(protected.protected_paths())
  assert Sandbox(LIMITS).run("print('ran')").stdout.strip() == "ran"  # hidden: runs


def test_seccomp_denies_new_namespaces_and_mounts(sandbox):
  import platform
  if platform.machine() not in ("x86_64", "aarch64"):
    pytest.skip("no seccomp syscall table for this architecture")
  r = sandbox.run(
      "import ctypes, os, threading, subprocess\n"
      "libc = ctypes.CDLL(None, use_errno=True)\n"
      "rc = libc.unshare(0x10000000 | 0x00020000)  # CLONE_NEWUSER | CLONE_NEWNS\n"
      "print('unshare', rc, ctypes.get_errno())\n"
      "rc = libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)\n"
      "print('mount', rc, ctypes.get_errno())\n"
      "t = threading.Thread(target=lambda: print('thread ok')); t.start(); t.join()\n"
      "print(subprocess.run(['echo', 'child ok'], capture_output=True, text=True).stdout.strip())\n"
      "pid = os.fork()\n"
      "if pid == 0:\n    os._exit(7)\n"
      "print('fork', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n")
  assert r.status == "ok", r
  assert r.stdout.splitlines() == ["unshare -1 1", "mount -1 1", "thread ok", "child ok",
                                   "fork 7"], r.stdout
  assert sandbox.capabilities()["seccomp"]
