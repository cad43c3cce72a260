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
