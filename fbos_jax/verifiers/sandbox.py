"""A sandbox for running untrusted Python programs (the code verifier's runner).

What a run gets (``Sandbox.run(source, stdin)``), in layers:

1. **Its own temp directory** ``<root>/work`` as cwd and ``$HOME``. ``<root>``
   (``tempfile.mkdtemp``) holds the stdin/stdout/stderr files and is not
   writable by the program, so ``../outside.txt`` fails.
2. **Linux namespaces** (via util-linux ``unshare``; as root directly, as
   another user through a user namespace), when they work on the host:
     * a network namespace: no interfaces but a down loopback, so no network;
     * a PID namespace whose init is the program itself: when the program
       exits or is killed, the kernel kills every process it left behind,
       even ones that called ``setsid`` to leave the process group;
     * a mount namespace in which every existing mount is remounted
       **read-only**, fresh size-capped ``tmpfs`` are mounted over ``/tmp``,
       ``/var/tmp`` and ``/dev/shm`` (private, gone after the run), and only
       the working directory is writable. If the interpreter lives under a
       directory other users cannot enter (e.g. pyenv under ``/root``), that
       directory is covered by an empty tmpfs with only the interpreter's
       tree bound back in, so the run's uid can start Python and sees nothing
       else there.
3. **rlimits**: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``),
   process count (``RLIMIT_NPROC``), file size (``RLIMIT_FSIZE``, which also
   caps stdout/stderr), open files, no core dumps.
   ``RLIMIT_NPROC`` is not enforced for root, so when the trainer runs as root
   the program runs under its own unprivileged uid (``uid_base + slot``, one
   per concurrent run, so runs do not share a process budget).
4. **Wall-clock timeout**; the program runs in a new session and its whole
   process group is SIGKILLed on timeout and after every run. Without a PID
   namespace, a root trainer also kills every process of the run's uid.
5. **An audit hook** (``sys.addaudithook``) inside the program's interpreter
   that refuses sockets and writes outside the working directory with a
   clear ``PermissionError``. It gives readable errors and covers hosts
   without namespaces, but it is not a security boundary on its own
   (ctypes or a child process can bypass it); the OS layers above are.

``Sandbox.capabilities()`` reports which layers are active on this host (it
probes once, by running a tiny program through the full stack, and falls back
to fewer layers with a logged warning when the host refuses namespaces, as
Docker's default seccomp profile does; ``isolation="namespaces"`` makes that
an error instead).

This file also runs as a script: ``python -I sandbox.py --boot <json>`` is the
in-sandbox bootstrap (it imports only the standard library).
"""

from __future__ import annotations

# The bootstrap below runs before any other import, so that a sandboxed run
# starts fast: it needs only these three modules.
import json
import os
import sys

SETUP_FAILED_EXIT = 120  # exit code of a bootstrap that could not set up
SETUP_FAILED_MARK = "FBOS_SANDBOX_SETUP_FAILED"


# ---------------------------------------------------------------------------
# Sandbox side (runs as ``python -I sandbox.py --boot <json>``).

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME = 32, 1024, 2048
_MS_BIND, _MS_REC, _MS_RELATIME = 4096, 16384, 1 << 21
_MOUNT_OPTS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC,
               "noatime": _MS_NOATIME, "nodiratime": _MS_NODIRATIME,
               "relatime": _MS_RELATIME}


def _mount(src, target, fstype, flags, data=None) -> None:
  import ctypes  # pylint: disable=g-import-not-at-top

  libc = ctypes.CDLL(None, use_errno=True)
  enc = lambda s: None if s is None else os.fsencode(s)
  if libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags),
                enc(data)) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"mount {src} on {target}: {os.strerror(err)}")


def _hidden_ancestor(path: str) -> str | None:
  """The top-most proper ancestor of ``path`` that other users cannot
  traverse (no o+x), or None."""
  parts = path.strip("/").split("/")
  for i in range(len(parts) - 1):
    a = "/" + "/".join(parts[:i + 1])
    try:
      if not os.stat(a).st_mode & 0o001:
        return a
    except OSError:
      return None
  return None


def _private_fs(root: str, work: str, tmpfs_mb: int, expose: list[str]) -> None:
  """Inside a fresh mount namespace: everything read-only but ``work``;
  private tmpfs on /tmp, /var/tmp, /dev/shm; and each path in ``expose`` made
  reachable when an ancestor is closed to other users (e.g. an interpreter
  under /root): that ancestor is covered by an empty read-only tmpfs and only
  the exposed path is bound back in, so the rest of it stays hidden."""
  fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in [root, work]}
  overlays: dict[str, list[str]] = {}
  for p in expose:
    a = _hidden_ancestor(p)
    if a is not None and os.path.isdir(p):
      overlays.setdefault(a, []).append(p)
      fds.setdefault(p, os.open(p, os.O_PATH | os.O_DIRECTORY))
  with open("/proc/self/mountinfo") as f:
    mounts = []
    for line in f:
      fields = line.split()
      mp = fields[4].encode().decode("unicode_escape")  # "\040" -> " "
      mounts.append((mp, fields[5].split(",")))
  for mp, opts in mounts:
    if mp == "/proc" or mp.startswith(("/proc/", "/sys", "/dev")):
      continue
    flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
    for o in opts:
      flags |= _MOUNT_OPTS.get(o, 0)
    try:
      _mount(None, mp, None, flags)
    except OSError:
      if "ro" not in opts:  # a writable mount we cannot lock: fail closed
        raise
  for d in ("/tmp", "/var/tmp", "/dev/shm"):
    if os.path.isdir(d) and not os.path.islink(d):
      _mount("tmpfs", d, "tmpfs", _MS_NOSUID | _MS_NODEV,
             f"size={tmpfs_mb}m,mode=1777")
  for a, paths in overlays.items():
    _mount("tmpfs", a, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    for p in paths:
      os.makedirs(p, exist_ok=True)
      _mount(f"/proc/self/fd/{fds[p]}", p, None, _MS_BIND)
    _mount(None, a, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
  if not os.path.isdir(work):  # the root dir was under a fresh tmpfs
    os.makedirs(root, exist_ok=True)
    _mount(f"/proc/self/fd/{fds[root]}", root, None, _MS_BIND)
  _mount(f"/proc/self/fd/{fds[work]}", work, None, _MS_BIND)
  _mount(None, work, None, _MS_REMOUNT | _MS_BIND | _MS_NOSUID | _MS_NODEV)
  for fd in fds.values():
    os.close(fd)


def _install_guard(work: str) -> None:
  """Audit hook: no sockets, no writes outside ``work`` (see module doc)."""
  work_real = os.path.realpath(work)
  write_flags = (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND |
                 os.O_TRUNC)
  path_events = {"os.remove", "os.rename", "os.replace", "os.mkdir",
                 "os.rmdir", "os.chmod", "os.chown", "os.symlink", "os.link",
                 "os.truncate", "os.utime", "shutil.rmtree", "os.chdir"}
  realpath, fsdecode, sep = os.path.realpath, os.fsdecode, os.sep

  def inside(p) -> bool:
    try:
      full = realpath(fsdecode(p))
    except Exception:  # pylint: disable=broad-except
      return False
    return full == work_real or full.startswith(work_real + sep) or (
        full == "/dev/null")

  def hook(event, args):
    if event == "open":
      path, mode, flags = args
      if path is None or isinstance(path, int):
        return
      writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
          isinstance(flags, int) and flags & write_flags)
      if writing and not inside(path):
        raise PermissionError(
            f"sandbox: writing outside the working directory is not allowed: "
            f"{fsdecode(path)!r}")
    elif event in path_events:
      for a in args:
        if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
          raise PermissionError(
              f"sandbox: {event} outside the working directory is not "
              f"allowed: {fsdecode(a)!r}")
    elif event.startswith("socket."):
      raise PermissionError(f"sandbox: network access is disabled ({event})")

  sys.addaudithook(hook)


def _boot(cfg: dict) -> None:
  import resource  # pylint: disable=g-import-not-at-top

  try:
    if cfg["private_fs"]:
      _private_fs(cfg["root"], cfg["work"], cfg["file_mb"] * 4,
                  cfg["expose"] if cfg["uid"] is not None else [])
    mb = 1 << 20
    for res, val in ((resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1)),
                     (resource.RLIMIT_AS, (cfg["memory_mb"] * mb,) * 2),
                     (resource.RLIMIT_NPROC, (cfg["nproc"],) * 2),
                     (resource.RLIMIT_FSIZE, (cfg["file_mb"] * mb,) * 2),
                     (resource.RLIMIT_NOFILE, (cfg["nofile"],) * 2),
                     (resource.RLIMIT_CORE, (0, 0))):
      resource.setrlimit(res, val)
    if cfg["uid"] is not None:
      os.setgroups([])
      os.setgid(cfg["uid"])
      os.setuid(cfg["uid"])
    os.chdir(cfg["work"])
    os.umask(0o077)
  except BaseException as e:  # pylint: disable=broad-except
    print(f"{SETUP_FAILED_MARK}: {type(e).__name__}: {e}", file=sys.stderr)
    sys.stderr.flush()
    os._exit(SETUP_FAILED_EXIT)  # pylint: disable=protected-access
  program = cfg["program"]
  with open(program, encoding="utf-8", errors="replace") as f:
    source = f.read()
  sys.argv = [program]
  sys.path.insert(0, cfg["work"])
  if cfg["guard"]:
    _install_guard(cfg["work"])
  main = type(sys)("__main__")  # a fresh __main__ module for the program
  main.__file__ = program
  sys.modules["__main__"] = main
  try:
    # "main.py" (relative to the cwd) keeps temp paths out of tracebacks.
    exec(compile(source, "main.py", "exec"), main.__dict__)  # pylint: disable=exec-used
  except SystemExit:
    raise
  except BaseException as e:  # pylint: disable=broad-except
    import traceback  # pylint: disable=g-import-not-at-top
    me = os.path.abspath(__file__)
    frames = [fr for fr in traceback.extract_tb(e.__traceback__)
              if fr.filename != me]  # hide the bootstrap and the audit hook
    while frames and frames[0].filename != "main.py":
      frames.pop(0)
    sys.stderr.write("Traceback (most recent call last):\n" + "".join(
        traceback.format_list(frames) + traceback.format_exception_only(
            type(e), e)))
    sys.stderr.flush()
    sys.exit(1)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--boot":
  _boot(json.loads(sys.argv[2]))
  sys.exit(0)  # the program finished normally

# ---------------------------------------------------------------------------
# Host side.

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import Any


class SandboxError(RuntimeError):
  """The sandbox itself failed (not the program in it)."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Resource limits of one run.

  Attributes:
    wall_s: wall-clock limit in seconds.
    cpu_s: CPU-time limit per process in seconds (``RLIMIT_CPU``, rounded up).
    memory_mb: address-space limit per process (``RLIMIT_AS``).
    max_processes: process/thread count limit (``RLIMIT_NPROC``).
    max_file_mb: largest file the program may write, stdout/stderr included
      (``RLIMIT_FSIZE``), and the size of each private tmpfs.
    max_output_bytes: how much of stdout/stderr is read back.
    max_open_files: ``RLIMIT_NOFILE``.
  """

  wall_s: float = 5.0
  cpu_s: float = 4.0
  memory_mb: int = 512
  max_processes: int = 16
  max_file_mb: int = 16
  max_output_bytes: int = 1 << 16
  max_open_files: int = 64


@dataclasses.dataclass(frozen=True)
class RunResult:
  """The outcome of one run.

  Attributes:
    status: "ok" (exit 0), "runtime_error" (non-zero exit or a signal),
      "timeout" (wall or CPU limit), "memory" (a MemoryError), or
      "output_limit" (wrote past ``max_file_mb``).
    returncode: the exit status (negative: killed by that signal); None if
      the run was killed on timeout.
    stdout / stderr: decoded output, at most ``max_output_bytes`` each.
    wall_s: elapsed seconds.
  """

  status: str
  returncode: int | None
  stdout: str
  stderr: str
  wall_s: float

  @property
  def ok(self) -> bool:
    return self.status == "ok"


_PROBE_PROGRAM = "import heapq, json, subprocess, traceback\nprint('ok')\n"
_UNSHARE_ROOT = ["unshare", "--net", "--pid", "--fork", "--kill-child",
                 "--mount-proc"]
_UNSHARE_USER = ["unshare", "--user", "--map-root-user", "--net", "--pid",
                 "--fork", "--kill-child", "--mount-proc"]


def _read_tail(path: str, limit: int) -> tuple[str, int]:
  """Returns (up to ``limit`` bytes of the file, decoded; its full size)."""
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      data = f.read(limit)
  except OSError:
    return "", 0
  return data.decode("utf-8", errors="replace"), size


def _user_task_count(uid: int) -> int:
  """Threads + processes that ``uid`` owns now (what RLIMIT_NPROC counts)."""
  n = 0
  for pid in os.listdir("/proc"):
    if not pid.isdigit():
      continue
    try:
      with open(f"/proc/{pid}/status") as f:
        status = f.read()
    except OSError:
      continue
    fields = dict(line.split(":", 1) for line in status.splitlines()
                  if ":" in line)
    if int(fields.get("Uid", "-1").split()[0]) == uid:
      n += int(fields.get("Threads", "1").strip() or 1)
  return n


def _child_pids(pid: int) -> list[int]:
  """Direct children of ``pid``."""
  try:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
      return [int(c) for c in f.read().split()]
  except OSError:  # kernels without CONFIG_PROC_CHILDREN: scan /proc
    out = []
    for p in os.listdir("/proc"):
      if p.isdigit():
        try:
          with open(f"/proc/{p}/stat") as f:
            if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
              out.append(int(p))
        except (OSError, IndexError, ValueError):
          pass
    return out


def kill_uid(uid: int, rounds: int = 5) -> int:
  """SIGKILLs every process owned by ``uid`` (root only); returns how many."""
  killed = 0
  for _ in range(rounds):
    found = 0
    for pid in os.listdir("/proc"):
      if not pid.isdigit():
        continue
      try:
        if os.stat(f"/proc/{pid}").st_uid == uid:
          os.kill(int(pid), signal.SIGKILL)
          found += 1
      except OSError:
        continue
    killed += found
    if not found:
      break
    time.sleep(0.01)
  return killed


class Sandbox:
  """Runs untrusted Python source under the layers described in the module doc.

  Args:
    limits: default ``SandboxLimits`` (``run`` can override per call).
    python: the interpreter for the program (must be readable by the
      sandbox uid when the trainer runs as root).
    isolation: "auto" (namespaces if this host allows them, else none, with
      a warning), "namespaces" (raise if unavailable), or "none".
    uid_base: first uid used for runs when the trainer is root.
    max_concurrency: how many runs may be in flight at once (uid slots).
    python_guard: install the audit hook (see module doc).
  """

  def __init__(
      self,
      limits: SandboxLimits = SandboxLimits(),
      *,
      python: str = sys.executable,
      isolation: str = "auto",
      uid_base: int = 61000,
      max_concurrency: int = 64,
      python_guard: bool = True,
  ):
    if isolation not in ("auto", "namespaces", "none"):
      raise ValueError(f"isolation must be auto|namespaces|none: {isolation!r}")
    self.limits = limits
    self.python = python
    self.isolation = isolation
    self.uid_base = uid_base
    self.python_guard = python_guard
    self._is_root = os.geteuid() == 0
    self._slots = threading.BoundedSemaphore(max_concurrency)
    self._free = list(range(max_concurrency))
    self._lock = threading.Lock()  # guards the free-slot list
    self._probe_lock = threading.Lock()
    self._caps: dict[str, Any] | None = None

  # -- capabilities --------------------------------------------------------

  def capabilities(self) -> dict[str, Any]:
    """Which isolation layers are active here (probes once, then cached).

    Returns a dict with keys: ``namespaces`` (net+pid+mount), ``read_only_fs``,
    ``drop_uid`` (root trainer runs programs under another uid),
    ``nproc_enforced``, ``python_guard``, ``prefix`` (the unshare command),
    and ``notes`` (why a layer is off).
    """
    with self._probe_lock:
      if self._caps is None:
        self._caps = self._probe()
      return dict(self._caps)

  def _probe(self) -> dict[str, Any]:
    from absl import logging  # pylint: disable=g-import-not-at-top

    notes = []
    options = []
    if self.isolation != "none" and shutil.which("unshare"):
      options.append(_UNSHARE_ROOT if self._is_root else _UNSHARE_USER)
    elif self.isolation != "none":
      notes.append("the unshare command is not installed")
    options.append(None)
    for prefix in options:
      for drop in ([True, False] if self._is_root else [False]):
        caps = {"namespaces": prefix is not None, "read_only_fs": prefix is not None,
                "drop_uid": drop, "prefix": prefix,
                "python_guard": self.python_guard}
        caps["nproc_enforced"] = drop or not self._is_root
        self._caps = caps
        try:
          # Importing unloaded stdlib modules checks the uid can read them.
          res = self._run(caps, _PROBE_PROGRAM, "", SandboxLimits(wall_s=20))
          if res.stdout.strip() == "ok":
            caps["notes"] = notes
            if prefix is None and self.isolation == "namespaces":
              raise SandboxError(f"namespaces unavailable: {notes}")
            if prefix is None and self.isolation == "auto":
              logging.warning("code sandbox: running WITHOUT namespaces "
                              "(no OS-level network/filesystem isolation): %s",
                              notes)
            if self._is_root and not drop:
              logging.warning("code sandbox: cannot switch to an unprivileged "
                              "uid; RLIMIT_NPROC is not enforced: %s", notes)
            return caps
          notes.append(f"probe prefix={prefix} drop_uid={drop}: "
                       f"{res.status} {res.stderr[-300:]!r}")
        except SandboxError as e:
          if self.isolation == "namespaces" and prefix is None:
            raise
          notes.append(f"probe prefix={prefix} drop_uid={drop}: {e}")
        finally:
          self._caps = None
    raise SandboxError(f"the sandbox cannot run a trivial program: {notes}")

  # -- running -------------------------------------------------------------

  def run(self, source: str, stdin: str = "", *,
          limits: SandboxLimits | None = None) -> RunResult:
    """Runs Python ``source`` with ``stdin``; never leaves anything running.

    Args:
      source: the program text (run as ``__main__`` from ``work/main.py``).
      stdin: text fed to the program's standard input.
      limits: per-call override of the default limits.

    Returns:
      A ``RunResult``.

    Raises:
      SandboxError: the sandbox could not be set up (not the program's fault).
    """
    caps = self.capabilities()
    return self._run(caps, source, stdin, limits or self.limits)

  def _run(self, caps, source: str, stdin: str,
           limits: SandboxLimits) -> RunResult:
    with self._slots:
      with self._lock:
        slot = self._free.pop()
      try:
        return self._run_in_slot(caps, slot, source, stdin, limits)
      finally:
        with self._lock:
          self._free.append(slot)

  def _run_in_slot(self, caps, slot, source, stdin, limits) -> RunResult:
    uid = self.uid_base + slot if caps["drop_uid"] else None
    root = tempfile.mkdtemp(prefix="fbos_sbx_")
    work = os.path.join(root, "work")
    try:
      os.chmod(root, 0o711)  # the run's uid may pass through, not write
      os.mkdir(work, 0o700)
      program = os.path.join(work, "main.py")
      with open(program, "w") as f:
        f.write(source)
      if uid is not None:
        for p in (work, program):
          os.chown(p, uid, uid)
      with open(os.path.join(root, "stdin"), "w") as f:
        f.write(stdin)
      if caps["namespaces"] or uid is not None:
        nproc = limits.max_processes
      else:  # counts all of this user's tasks: leave room for the trainer's
        nproc = _user_task_count(os.getuid()) + limits.max_processes
      cfg = {
          "root": root, "work": work, "program": program, "uid": uid,
          "private_fs": caps["read_only_fs"], "guard": caps["python_guard"],
          "cpu_s": int(-(-limits.cpu_s // 1)), "memory_mb": limits.memory_mb,
          "nproc": nproc, "file_mb": limits.max_file_mb,
          "nofile": limits.max_open_files,
          # The interpreter's trees, which the run's uid must be able to read.
          "expose": sorted({os.path.realpath(p) for p in (
              sys.base_prefix, sys.prefix,
              os.path.dirname(os.path.realpath(self.python)),
              os.path.dirname(os.path.abspath(__file__)))}),
      }
      cmd = list(caps["prefix"] or []) + [
          self.python, "-I", "-B", os.path.abspath(__file__), "--boot",
          json.dumps(cfg)]
      env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work,
             "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
      out_path = os.path.join(root, "stdout")
      err_path = os.path.join(root, "stderr")
      t0 = time.monotonic()
      timed_out = False
      with open(os.path.join(root, "stdin"), "rb") as fin, \
          open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
        proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr,
                                env=env, cwd=root, start_new_session=True,
                                close_fds=True)
        try:
          rc = proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
          timed_out = True
          if caps["namespaces"]:
            # Kill the PID namespace's init first: the kernel then kills the
            # rest of the namespace and unshare exits only once it is empty.
            for child in _child_pids(proc.pid):
              try:
                os.kill(child, signal.SIGKILL)
              except ProcessLookupError:
                pass
            try:
              proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
              pass
        finally:
          try:
            os.killpg(proc.pid, signal.SIGKILL)
          except (ProcessLookupError, PermissionError):
            pass
          rc_after = proc.wait()
          if uid is not None and not caps["namespaces"]:
            kill_uid(uid)
      wall = time.monotonic() - t0
      rc = None if timed_out else rc_after
      stdout, _ = _read_tail(out_path, limits.max_output_bytes)
      stderr, _ = _read_tail(err_path, limits.max_output_bytes)
      if rc == SETUP_FAILED_EXIT and SETUP_FAILED_MARK in stderr:
        raise SandboxError(stderr.strip()[-1000:])
      if timed_out or rc in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        status = "timeout"
      elif rc in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or (
          rc != 0 and "File too large" in stderr):  # Python ignores SIGXFSZ
        status = "output_limit"
      elif rc != 0 and "MemoryError" in stderr:
        status = "memory"
      elif rc != 0:
        status = "runtime_error"
      else:
        status = "ok"
      return RunResult(status, rc, stdout, stderr, wall)
    finally:
      shutil.rmtree(root, ignore_errors=True)


