"""Containment tests for the code sandbox and tests for the code verifier.

Each hostile program must be stopped within its limits, leave nothing behind,
and come back as a clear result / verdict.
"""

import os
import socket
import time

import pytest

from fbos_jax.verifiers import get_verifier
from fbos_jax.verifiers.sandbox import Sandbox
from fbos_jax.verifiers.sandbox import SandboxLimits

LIMITS = SandboxLimits(wall_s=1.5, cpu_s=1, memory_mb=256, max_processes=16)


@pytest.fixture(scope="module")
def sandbox():
  sb = Sandbox(LIMITS)
  print("sandbox capabilities:", sb.capabilities())
  return sb


def _boot_processes() -> list[int]:
  """PIDs of sandbox bootstraps (and their forks) still alive on the host."""
  out = []
  for pid in os.listdir("/proc"):
    if not pid.isdigit():
      continue
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmd = f.read()
    except OSError:
      continue
    if b"sandbox.py" in cmd and b"--boot" in cmd:
      out.append(int(pid))
  return out


def _processes_matching(marker: bytes) -> list[int]:
  out = []
  for pid in os.listdir("/proc"):
    if pid.isdigit():
      try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
          if marker in f.read():
            out.append(int(pid))
      except OSError:
        pass
  return out


def test_plain_run_stdin_and_cwd(sandbox):
  r = sandbox.run("import os, sys\nprint(sys.stdin.read().upper())\nprint(os.getcwd())",
                  "hello")
  assert r.status == "ok" and r.returncode == 0
  lines = r.stdout.splitlines()
  assert lines[0] == "HELLO" and lines[1].endswith("/work")
  assert not os.path.exists(lines[1])  # the temp dir is removed afterwards


def test_infinite_loop_is_stopped(sandbox):
  t0 = time.monotonic()
  r = sandbox.run("while True:\n    pass\n")
  assert r.status == "timeout"
  assert time.monotonic() - t0 < LIMITS.wall_s + 2
  assert not _boot_processes()


def test_fork_bomb_is_contained(sandbox):
  if not sandbox.capabilities()["nproc_enforced"]:
    pytest.skip("this host cannot enforce a process-count limit")
  t0 = time.monotonic()
  r = sandbox.run("import os\nwhile True:\n    try:\n        os.fork()\n"
                  "    except OSError:\n        pass\n")
  assert r.status in ("timeout", "runtime_error")
  assert time.monotonic() - t0 < LIMITS.wall_s + 3
  assert not _boot_processes()  # every fork is gone


def test_memory_bomb_is_contained(sandbox):
  r = sandbox.run("blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))\n")
  assert r.status == "memory"
  assert "MemoryError" in r.stderr


def test_write_outside_the_temp_dir_is_refused(sandbox, tmp_path):
  target = tmp_path / "victim"
  target.mkdir()
  os.chmod(tmp_path, 0o777)
  os.chmod(target, 0o777)  # even a world-writable directory stays untouched
  r = sandbox.run("open('../outside.txt', 'w').write('x')")
  assert r.status == "runtime_error"
  assert "PermissionError" in r.stderr and "outside.txt" in r.stderr
  r = sandbox.run(f"open({str(target / 'outside.txt')!r}, 'w').write('x')")
  assert r.status == "runtime_error"
  assert not (target / "outside.txt").exists()
  if sandbox.capabilities()["read_only_fs"]:
    # A child process has no audit hook: the OS layer must stop it.
    r = sandbox.run(
        "import os\n"
        "print(os.system('echo x > ../outside.txt'))\n"
        f"print(os.system('echo x > {target}/outside2.txt'))\n"
        "print(os.system('echo x > inside.txt'))\n")
    codes = r.stdout.split()
    assert codes[0] != "0" and codes[2] == "0", r
    assert not (target / "outside2.txt").exists()


def test_network_socket_is_refused(sandbox):
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(4)
  port = server.getsockname()[1]
  src = ("import socket\n"
         f"s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
         "s.sendall(b'leak')\n")
  r = sandbox.run(src)
  assert r.status == "runtime_error"
  assert "network access is disabled" in r.stderr
  if sandbox.capabilities()["namespaces"]:
    # Without the Python guard the network namespace still has no route out.
    r = Sandbox(LIMITS, python_guard=False).run(src)
    assert r.status == "runtime_error"
    assert r.stderr.splitlines()[-1] == "OSError: [Errno 101] Network is unreachable"
  # A completed connection would sit in the listen backlog: there is none.
  server.setblocking(False)
  with pytest.raises(BlockingIOError):
    server.accept()
  server.close()


def test_child_process_left_running_is_killed(sandbox):
  marker = "987.654321"
  caps = sandbox.capabilities()
  # A child that leaves the process group (setsid) needs the PID namespace or
  # the run's own uid to be found; a plain one is killed with the group.
  escape = caps["namespaces"] or caps["drop_uid"]
  r = sandbox.run(
      "import subprocess\n"
      f"subprocess.Popen(['sleep', '{marker}'], start_new_session={escape})\n"
      f"subprocess.Popen(['sh', '-c', 'sleep {marker}; sleep {marker}'])\n"
      "print('spawned')\n")
  assert r.status == "ok" and r.stdout.strip() == "spawned"
  deadline = time.monotonic() + 2
  while _processes_matching(marker.encode()) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not _processes_matching(marker.encode())
  assert not _boot_processes()


def test_output_flood_is_capped(sandbox):
  r = sandbox.run("while True:\n    print('x' * 10000)\n")
  assert r.status == "output_limit"
  assert len(r.stdout) <= LIMITS.max_output_bytes


# --------------------------------------------------------------- verifier

TESTS = [{"input": "3 4\n", "output": "7\n"}, {"input": "10 -2", "output": "8"}]


@pytest.fixture(scope="module")
def code_verifier(sandbox):
  return get_verifier("code", wall_s=1.5, cpu_s=1, memory_mb=256, sandbox=sandbox)


def test_code_verifier_correct(code_verifier):
  src = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
  v = code_verifier({"tests": TESTS}, "Here:\n" + src)
  assert (v.reward, v.feedback) == (1.0, "correct")


def test_code_verifier_wrong_answer_feedback(code_verifier):
  v = code_verifier({"tests": TESTS}, "a, b = map(int, input().split())\nprint(a * b)")
  assert v.reward == 0.0
  assert v.feedback == "test 1 failed: wrong answer\ninput: 3 4\nexpected: 7\ngot: 12"


def test_code_verifier_runtime_error_feedback(code_verifier):
  v = code_verifier({"tests": TESTS}, "def f(x):\n    return 1 // x\nprint(f(0))")
  assert v.feedback.startswith("test 1 failed: runtime error\ninput: 3 4\nerror: ")
  assert 'File "main.py", line 2, in f' in v.feedback
  assert v.feedback.endswith("ZeroDivisionError: integer division or modulo by zero")


@pytest.mark.parametrize("program,first_line", [
    ("while True: pass", "test 1 failed: time limit exceeded (1.5 s wall, 1 s CPU)"),
    ("x = bytearray(10**10)", "test 1 failed: memory limit exceeded (256 MB)"),
    ("open('../outside.txt', 'w')", "test 1 failed: runtime error"),
])
def test_code_verifier_hostile_programs_get_clear_verdicts(code_verifier, program,
                                                           first_line):
  v = code_verifier({"tests": TESTS}, program)
  assert v.reward == 0.0
  assert v.feedback.split("\n")[0] == first_line


def test_code_verifier_call_based_and_fraction(sandbox):
  ex = {"fn_name": "add", "tests": '[{"input": "[1, 2]", "output": "3"},'
                                   ' {"input": "[2, 2]", "output": "5"}]'}
  frac = get_verifier("code", reward_mode="fraction", sandbox=sandbox)
  v = frac(ex, "class Solution:\n    def add(self, a, b):\n        return a + b\n")
  assert v.reward == 0.5
  assert v.feedback == "test 2 failed: wrong answer\ninput: [2, 2]\nexpected: 5\ngot: 4"
  assert get_verifier("code", sandbox=sandbox)(ex, "").feedback == "no code found in the response"
