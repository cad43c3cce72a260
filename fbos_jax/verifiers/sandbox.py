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
     * a mount namespace with a **minimal root filesystem** (``pivot_root``
       into an empty tmpfs): read-only binds of the system's ``/usr``,
       ``/bin``, ``/lib*`` and dynamic-linker cache (``SYSTEM_PATHS``) and of
       the interpreter's own tree, ``/dev/{null,zero,full,random,urandom}``,
       the PID namespace's ``/proc``, fresh size-capped ``tmpfs`` on ``/tmp``,
       ``/var/tmp`` and ``/dev/shm`` (private, gone after the run), and the
       working directory, the only writable host path. Nothing else of the
       host exists in there: not the datasets, the repository, home
       directories, ``/etc/passwd``, other mounts (a solution that opens its
       own test file gets ``FileNotFoundError``). A probe checks this on
       every new ``Sandbox`` (a host file must be invisible) and fails
       closed.
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
probes once, by running a tiny program through the full stack). When the host
refuses namespaces (as Docker's default seccomp profile does), the default
``isolation="namespaces"`` makes every run raise ``SandboxError`` (the code
verifier turns that into an error verdict, never a reward): untrusted code is
never run unconfined by accident. ``isolation="auto"`` falls back to fewer
layers with a logged warning, ``"none"`` skips them; both are for trusted code.

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


# pivot_root(2) has no libc wrapper: its syscall number per architecture.
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41,
                   "loongarch64": 41, "ppc64le": 203, "ppc64": 203,
                   "s390x": 217}
_MNT_DETACH = 2
# statvfs f_flag bits that are per-mount flags a user namespace may lock.
_ST_TO_MS = ((1, _MS_RDONLY), (2, _MS_NOSUID), (4, _MS_NODEV),
             (8, _MS_NOEXEC), (1024, _MS_NOATIME), (2048, _MS_NODIRATIME),
             (4096, _MS_RELATIME))
_DEVICES = ("null", "zero", "full", "random", "urandom")


def _locked_flags(path: str) -> int:
  """The mount flags of the mount holding ``path`` (kept on a remount: a
  user namespace may not clear them)."""
  f_flag = os.statvfs(path).f_flag
  return sum(ms for st, ms in _ST_TO_MS if f_flag & st)


def _bind(src: str, target: str, *, read_only: bool, nodev: bool = True) -> None:
  """Bind-mounts ``src`` on ``target`` (non-recursive where the kernel
  allows, so sub-mounts stay hidden), then remounts it nosuid (+ ro, nodev)."""
  try:
    _mount(src, target, None, _MS_BIND)
  except OSError as e:
    import errno  # pylint: disable=g-import-not-at-top
    if e.errno != errno.EINVAL:  # a user namespace may insist on MS_REC
      raise
    _mount(src, target, None, _MS_BIND | _MS_REC)
  flags = _MS_REMOUNT | _MS_BIND | _MS_NOSUID | _locked_flags(src)
  flags |= (_MS_RDONLY if read_only else 0) | (_MS_NODEV if nodev else 0)
  _mount(None, target, None, flags)


def _mountpoint(target: str, like: str) -> None:
  """Creates an empty directory or file at ``target`` to mount ``like`` on."""
  if os.path.lexists(target):
    return
  os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
  if os.path.isdir(like):
    os.makedirs(target, mode=0o755, exist_ok=True)
  else:
    os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))


def _private_fs(root: str, work: str, tmpfs_mb: int, expose: list[str],
                links: dict[str, str]) -> None:
  """Inside a fresh mount namespace: switch to a minimal root filesystem.

  The new root is an empty tmpfs (mounted over ``root``, the run's own temp
  directory) holding only: read-only binds of each path in ``expose`` (the
  system's ``/usr``, ``/bin``, ``/lib*``, the dynamic-linker cache and the
  interpreter's own tree), the symlinks in ``links`` (e.g. a venv's
  ``python`` -> the real interpreter), a few device nodes, this PID
  namespace's ``/proc``, private size-capped tmpfs on ``/tmp``, ``/var/tmp``
  and ``/dev/shm``, and ``work`` (read-write) at its own path. Then
  ``pivot_root`` into it and detach the old root, so no other host file
  (datasets, the repository, home directories, ``/etc``) can be reached.
  Any step that fails raises: the bootstrap reports a setup failure and the
  program never runs (fail closed).
  """
  import ctypes  # pylint: disable=g-import-not-at-top
  import platform  # pylint: disable=g-import-not-at-top

  arch = platform.machine()
  if arch not in _SYS_PIVOT_ROOT:
    raise OSError(f"pivot_root: unknown syscall number on {arch!r}")
  libc = ctypes.CDLL(None, use_errno=True)
  work_fd = os.open(work, os.O_PATH | os.O_DIRECTORY)
  work_flags = _locked_flags(work)  # before ``root`` (and ``work``) is covered
  new = root.rstrip("/")
  _mount("tmpfs", new, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
  for p in sorted(expose, key=len):  # ancestors before what they contain
    target = new + p
    if os.path.islink(p):
      if not os.path.lexists(target):
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        os.symlink(os.readlink(p), target)
      continue
    _mountpoint(target, p)
    _bind(p, target, read_only=True)
  for d in _DEVICES:
    if os.path.exists(f"/dev/{d}"):
      _mountpoint(f"{new}/dev/{d}", f"/dev/{d}")
      _bind(f"/dev/{d}", f"{new}/dev/{d}", read_only=False, nodev=False)
  _mountpoint(f"{new}/proc", "/proc")
  _mount("/proc", f"{new}/proc", None, _MS_BIND | _MS_REC)
  for d in ("/tmp", "/var/tmp", "/dev/shm"):
    os.makedirs(new + d, mode=0o755, exist_ok=True)
    _mount("tmpfs", new + d, "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={tmpfs_mb}m,mode=1777")
  for link, dest in links.items():
    if not os.path.lexists(new + link):
      os.makedirs(os.path.dirname(new + link), mode=0o755, exist_ok=True)
      os.symlink(dest, new + link)
  _mountpoint(new + work, "/")
  _mount(f"/proc/self/fd/{work_fd}", new + work, None, _MS_BIND)
  _mount(None, new + work, None,
         _MS_REMOUNT | _MS_BIND | _MS_NOSUID | _MS_NODEV | work_flags)
  os.close(work_fd)
  _mount(None, new, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
  os.chdir(new)
  if libc.syscall(ctypes.c_long(_SYS_PIVOT_ROOT[arch]), b".", b".") != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"pivot_root: {os.strerror(err)}")
  if libc.umount2(b".", ctypes.c_int(_MNT_DETACH)) != 0:  # the old root
    err = ctypes.get_errno()
    raise OSError(err, f"umount2(old root): {os.strerror(err)}")
  os.chdir("/")


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
      _private_fs(cfg["root"], cfg["work"], cfg["file_mb"] * 4, cfg["expose"],
                  cfg["links"])
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


# Imports unloaded stdlib modules (checks the run's uid can read them) and
# says whether a host file outside the exposed paths is visible from inside.
_PROBE_PROGRAM = ("import heapq, json, os, subprocess, traceback\nprint('ok')\n"
                  "print('visible' if os.path.exists({host_file!r}) else 'hidden')\n")
_PROBE_HOST_FILES = ("/etc/passwd", "/etc/hostname", "/etc/hosts")
# Host paths a run sees, read-only, besides its interpreter's tree: system
# binaries and shared libraries (symlinks such as /bin -> usr/bin are
# recreated, not bound) and the dynamic linker's cache. Nothing else of the
# host (no /etc/passwd, /home, /root, /work, /data, /mnt, the repository).
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                "/etc/ld.so.cache", "/etc/alternatives")
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
    isolation: "namespaces" (the default: refuse to run, with
      ``SandboxError``, when this host does not allow them), "auto"
      (namespaces if available, else run unconfined with a warning), or
      "none" (never; trusted code only).
    uid_base: first uid used for runs when the trainer is root.
    max_concurrency: how many runs may be in flight at once (uid slots).
    python_guard: install the audit hook (see module doc).
  """

  def __init__(
      self,
      limits: SandboxLimits = SandboxLimits(),
      *,
      python: str = sys.executable,
      isolation: str = "namespaces",
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
    self._probe_error: str | None = None
    self._exposed: list[str] | None = None

  # -- capabilities --------------------------------------------------------

  def capabilities(self) -> dict[str, Any]:
    """Which isolation layers are active here (probes once, then cached).

    Returns a dict with keys: ``namespaces`` (net+pid+mount), ``read_only_fs``
    (the minimal root filesystem), ``drop_uid`` (root trainer runs programs
    under another uid), ``nproc_enforced``, ``python_guard``, ``prefix`` (the
    unshare command), and ``notes`` (why a layer is off).

    Raises:
      SandboxError: with ``isolation="namespaces"`` (the default), when this
        host cannot run a program in namespaces with the minimal root (the
        error is cached: every later run raises it too, nothing runs
        unconfined).
    """
    with self._probe_lock:
      if self._probe_error is not None:
        raise SandboxError(self._probe_error)
      if self._caps is None:
        try:
          self._caps = self._probe()
        except SandboxError as e:
          self._probe_error = str(e)
          raise
      return dict(self._caps)

  def _probe(self) -> dict[str, Any]:
    from absl import logging  # pylint: disable=g-import-not-at-top

    notes = []
    options = []
    if self.isolation != "none" and shutil.which("unshare"):
      options.append(_UNSHARE_ROOT if self._is_root else _UNSHARE_USER)
    elif self.isolation != "none":
      notes.append("the unshare command is not installed")
    if self.isolation != "namespaces":
      options.append(None)
    probe = _PROBE_PROGRAM.format(host_file=self._probe_host_file())
    for prefix in options:
      for drop in ([True, False] if self._is_root else [False]):
        caps = {"namespaces": prefix is not None, "read_only_fs": prefix is not None,
                "drop_uid": drop, "prefix": prefix,
                "python_guard": self.python_guard}
        caps["nproc_enforced"] = drop or not self._is_root
        self._caps = caps
        try:
          res = self._run(caps, probe, "", SandboxLimits(wall_s=20))
          lines = res.stdout.split()
          if lines[:1] == ["ok"] and prefix is not None and lines[1:] != ["hidden"]:
            notes.append(f"probe prefix={prefix}: host files are visible "
                         "inside the sandbox")  # fail closed
          elif lines[:1] == ["ok"]:
            caps["notes"] = notes
            if prefix is None:
              logging.warning("code sandbox: running WITHOUT namespaces "
                              "(isolation=%r; no OS-level network/filesystem "
                              "isolation): %s", self.isolation, notes)
            if self._is_root and not drop:
              logging.warning("code sandbox: cannot switch to an unprivileged "
                              "uid; RLIMIT_NPROC is not enforced: %s", notes)
            return caps
          else:
            notes.append(f"probe prefix={prefix} drop_uid={drop}: "
                         f"{res.status} {res.stderr[-300:]!r}")
        except SandboxError as e:
          notes.append(f"probe prefix={prefix} drop_uid={drop}: {e}")
        finally:
          self._caps = None
    if self.isolation == "namespaces":
      raise SandboxError(
          "the code sandbox needs Linux namespaces (net, pid, mount) and a "
          "private root filesystem, which this host does not allow, so it "
          "refuses to run untrusted code unconfined. Allow unprivileged user "
          "namespaces (or run the trainer as root), or pass "
          f"Sandbox(isolation='none') for trusted code only. Details: {notes}")
    raise SandboxError(f"the sandbox cannot run a trivial program: {notes}")

  def _probe_host_file(self) -> str:
    """A host file that must be invisible inside (not under an exposed path)."""
    exposed = self._expose()
    for p in _PROBE_HOST_FILES + (os.path.abspath(__file__),):
      if os.path.exists(p) and not any(
          p == q or p.startswith(q.rstrip("/") + "/") for q in exposed):
        return p
    return "/etc"  # a directory every Linux host has, never exposed

  def _expose(self) -> list[str]:
    """Host paths bound read-only into a run's minimal root."""
    if self._exposed is None:
      paths = [p for p in SYSTEM_PATHS if os.path.lexists(p)]
      real = os.path.realpath(self.python)
      if real == os.path.realpath(sys.executable):
        base = sys.base_prefix
      else:  # another interpreter: ask it where its standard library lives
        base = subprocess.run(
            [self.python, "-I", "-c", "import sys; print(sys.base_prefix)"],
            capture_output=True, text=True, timeout=60, check=True).stdout.strip()
      for p in (os.path.realpath(base), os.path.dirname(real)):
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in paths):
          paths.append(p)
      self._exposed = sorted(set(paths))
    return list(self._exposed)

  def _links(self) -> dict[str, str]:
    """Symlinks recreated in the minimal root: the interpreter as named (e.g.
    a venv's bin/python) -> the real binary, so ``sys.executable`` works."""
    named = os.path.abspath(self.python)
    real = os.path.realpath(self.python)
    return {} if named == real else {named: real}

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
          # What the minimal root holds besides the run's own directory.
          "expose": self._expose(), "links": self._links(),
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


