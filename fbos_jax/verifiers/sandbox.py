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
       into an empty tmpfs) holding, read-only, only what the interpreter
       needs: its binary, its standard library directory (``lib-dynload``
       included) and every shared library that the binary and the standard
       library's extension modules load (as the dynamic loader finds them,
       ``ld.so --list``), the dynamic linker's cache, and a few tools
       (``Sandbox(tools=...)``: a shell, ``echo``, ``cat``, ``sleep``, each
       with its libraries); never a whole ``/usr`` (issue 23: a dataset under
       ``/usr/local/share`` or ``/usr/src/app`` was readable). Symlinks on the
       way (``/bin -> usr/bin``, ``libz.so.1 -> libz.so.1.2.13``) are recreated,
       not bound. Besides: ``/dev/{null,zero,full,random,urandom}``, the PID
       namespace's ``/proc``, fresh size-capped ``tmpfs`` on ``/tmp``,
       ``/var/tmp`` and ``/dev/shm`` (private, gone after the run), and the
       working directory, the only writable host path. Nothing else of the
       host exists in there: not the datasets, the repository, home
       directories, ``/etc/passwd``, other mounts (a solution that opens its
       own test file gets ``FileNotFoundError``). **Fail closed**: every
       run refuses (``SandboxError``) while a path declared with
       :func:`protect_path` (the data loader declares each data file and its
       directory, ``console.setup_logging`` the workdir) lies inside what is
       exposed, and a probe on every new ``Sandbox`` checks from inside that
       host files, ``/usr/share`` and the protected paths are invisible.
   A **seccomp filter** (installed by the bootstrap through ``prctl``, a small
   classic-BPF program, no new dependency; x86_64 and aarch64) then denies
   ``unshare``, ``setns``, ``mount`` and the new mount API, ``umount2``,
   ``pivot_root``, ``chroot``, and ``clone`` with any ``CLONE_NEW*`` flag
   (EPERM); ``clone3`` gets ENOSYS (its flags are behind a pointer, so libc
   falls back to ``clone``), and syscalls of another ABI (i386, x32) kill the
   program. So a program can no longer make itself a user + mount namespace
   and mount a tmpfs. The probe checks that ``unshare`` is denied.
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
  directory) holding only: read-only binds of each canonical path in
  ``expose`` (the interpreter, its standard library, the shared libraries
  they load, a few tools, the dynamic-linker cache), the symlinks in
  ``links`` (e.g. a venv's ``python`` -> the real interpreter, ``/lib`` ->
  ``usr/lib``), a few device nodes, this PID
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
    if os.path.islink(p) or os.path.realpath(p) != p:
      # Only canonical paths are bound (a mount point made through a symlink
      # could land on the host); links are recreated from ``links``.
      raise OSError(f"sandbox: refusing to bind {p!r}, not a canonical path")
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
  for link, dest in sorted(links.items(), key=lambda kv: len(kv[0])):
    parent = os.path.dirname(link)
    if os.path.realpath(parent) != parent:  # see above: never through a link
      raise OSError(f"sandbox: refusing to create link {link!r} under a symlink")
    if not os.path.lexists(new + link):
      os.makedirs(new + parent, mode=0o755, exist_ok=True)
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


# seccomp: the syscalls a run may not make (namespaces and mounts), per arch.
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7, "arm64": 0xC00000B7}
_DENIED_SYSCALLS = {  # name -> number; EPERM
    "x86_64": {"mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
               "unshare": 272, "setns": 308, "open_tree": 428, "move_mount": 429,
               "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
               "mount_setattr": 442},
    "aarch64": {"mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
                "unshare": 97, "setns": 268, "open_tree": 428, "move_mount": 429,
                "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
                "mount_setattr": 442},
}
_DENIED_SYSCALLS["arm64"] = _DENIED_SYSCALLS["aarch64"]
_SYS_CLONE = {"x86_64": 56, "aarch64": 220, "arm64": 220}
_SYS_CLONE3 = 435  # its flags sit behind a pointer: ENOSYS makes libc use clone
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_CLONE_NEW_MASK = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 \
    | 0x20000000 | 0x40000000


def seccomp_supported() -> bool:
  """Whether :func:`_install_seccomp` knows this architecture's syscalls."""
  import platform  # pylint: disable=g-import-not-at-top
  return platform.machine() in _DENIED_SYSCALLS


def _seccomp_program(arch: str) -> list[tuple[int, int, int, int]]:
  """The classic-BPF filter: (code, jt, jf, k) per instruction.

  A syscall of another ABI (i386 or x32 on x86_64) kills the process; the
  calls in ``_DENIED_SYSCALLS`` and ``clone`` with a ``CLONE_NEW*`` flag fail
  with EPERM, ``clone3`` with ENOSYS (glibc then falls back to ``clone``, whose
  flags a filter can read); everything else is allowed.
  """
  ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
  allow, kill = 0x7FFF0000, 0x80000000
  errno_ret = lambda e: 0x00050000 | e
  body = [("ld", 4), ("jeq_arch", _AUDIT_ARCH[arch]), ("ld", 0)]
  if arch == "x86_64":
    body.append(("jge_deny", 0x40000000))  # the x32 ABI
  body += [("jeq_deny", nr) for nr in sorted(_DENIED_SYSCALLS[arch].values())]
  body += [("jeq_enosys", _SYS_CLONE3), ("jne_allow", _SYS_CLONE[arch]),
           ("ld", 16), ("jset_deny", _CLONE_NEW_MASK)]
  tail = {"allow": len(body), "deny": len(body) + 1, "enosys": len(body) + 2,
          "kill": len(body) + 3}
  prog = []
  for i, (op, k) in enumerate(body):
    to = lambda label: tail[label] - i - 1  # pylint: disable=cell-var-from-loop
    if op == "ld":
      prog.append((ld, 0, 0, k))
    elif op == "jeq_arch":
      prog.append((jeq, 0, to("kill"), k))
    elif op == "jge_deny":
      prog.append((jge, to("deny"), 0, k))
    elif op == "jeq_deny":
      prog.append((jeq, to("deny"), 0, k))
    elif op == "jeq_enosys":
      prog.append((jeq, to("enosys"), 0, k))
    elif op == "jne_allow":
      prog.append((jeq, 0, to("allow"), k))
    elif op == "jset_deny":
      prog.append((jset, to("deny"), to("allow"), k))
  prog += [(ret, 0, 0, allow), (ret, 0, 0, errno_ret(1)), (ret, 0, 0, errno_ret(38)),
           (ret, 0, 0, kill)]
  return prog


def _install_seccomp() -> None:
  """Installs the filter of :func:`_seccomp_program` on this process (and so
  on everything it starts): no new namespaces, no mounts. Raises OSError."""
  import ctypes  # pylint: disable=g-import-not-at-top
  import platform  # pylint: disable=g-import-not-at-top

  class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte),
                ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

  class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

  arch = platform.machine()
  if arch not in _DENIED_SYSCALLS:
    raise OSError(f"seccomp: no syscall table for {arch!r}")
  prog = _seccomp_program(arch)
  filters = (SockFilter * len(prog))(*[SockFilter(*ins) for ins in prog])
  fprog = SockFprog(len(prog), ctypes.cast(filters, ctypes.POINTER(SockFilter)))
  libc = ctypes.CDLL(None, use_errno=True)
  ul = ctypes.c_ulong
  if libc.prctl(ctypes.c_int(38), ul(1), ul(0), ul(0), ul(0)) != 0:  # NO_NEW_PRIVS
    err = ctypes.get_errno()
    raise OSError(err, f"seccomp: prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
  if libc.prctl(ctypes.c_int(22), ul(2), ctypes.cast(ctypes.pointer(fprog), ctypes.c_void_p),
                ul(0), ul(0)) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    err = ctypes.get_errno()
    raise OSError(err, f"seccomp: prctl(PR_SET_SECCOMP): {os.strerror(err)}")


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
    if cfg.get("seccomp"):
      _install_seccomp()
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


# Imports unloaded stdlib modules (checks the run's uid can read them and
# that the libraries they load are there), says whether each host path listed
# is visible from inside, and whether a new user + mount namespace can be made
# (the seccomp filter must deny it).
_PROBE_PROGRAM = (
    "import heapq, json, os, subprocess, traceback, ctypes\nprint('ok')\n"
    "for p in {host_paths!r}:\n"
    "    print('visible' if os.path.lexists(p) else 'hidden', p)\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "print('unshare-allowed' if libc.unshare(0x10000000 | 0x00020000) == 0 "
    "else 'unshare-denied')\n")
_PROBE_HOST_FILES = ("/etc/passwd", "/etc/hostname", "/etc/hosts")
# Besides its interpreter (the binary, its standard library and every shared
# library they load: ``_interpreter_exposure``), a run sees only these host
# paths, read-only: the dynamic linker's cache, and the programs in
# ``Sandbox(tools=...)`` with their libraries. Never a whole /usr (a dataset
# under /usr/local/share or /usr/src/app stays invisible). Symlinks on the way
# (/bin -> usr/bin, libz.so.1 -> libz.so.1.2.13) are recreated, not bound.
SYSTEM_PATHS = ("/etc/ld.so.cache",)
DEFAULT_TOOLS = ("sh", "echo", "cat", "sleep")  # small POSIX tools (os.system)
_TOOL_PATH = "/usr/local/bin:/usr/bin:/bin"  # the PATH a run gets
PROTECTED_ENV = "FBOS_SANDBOX_PROTECTED"  # os.pathsep-joined protected paths
_protected: set[str] = set()


def protect_path(path: str) -> None:
  """Declares a host path (a dataset, a workdir) that no sandboxed program may
  see. Every ``Sandbox`` refuses to run (``SandboxError``) while one of them
  would be visible inside. Kept in this process and in ``$FBOS_SANDBOX_PROTECTED``
  so that verifier worker processes started later know it too. The data
  loader declares every data file and its directory;
  ``console.setup_logging`` the workdir."""
  if not path:
    return
  real = os.path.realpath(os.path.abspath(os.fspath(path)))
  if real == "/":
    return  # "/" is an ancestor of everything; nothing to check
  _protected.add(real)
  known = [p for p in os.environ.get(PROTECTED_ENV, "").split(os.pathsep) if p]
  if real not in known:
    os.environ[PROTECTED_ENV] = os.pathsep.join(known + [real])


def protected_paths() -> list[str]:
  """The paths declared with :func:`protect_path` (here or by a parent)."""
  env = [p for p in os.environ.get(PROTECTED_ENV, "").split(os.pathsep) if p]
  return sorted(_protected | set(env))


def _under(path: str, root: str) -> bool:
  return path == root or path.startswith(root.rstrip("/") + "/")


def _resolve(path: str, links: dict[str, str], limit: int = 64) -> str | None:
  """The canonical path of ``path``; every symlink met on the way is added to
  ``links`` as (its path, under a canonical directory) -> its target. None
  when ``path`` does not exist."""
  todo = [c for c in os.path.abspath(path).split("/") if c]
  cur = "/"
  hops = 0
  while todo:
    comp = todo.pop(0)
    if comp == ".":
      continue
    if comp == "..":
      cur = os.path.dirname(cur)
      continue
    cand = os.path.join(cur, comp)
    if os.path.islink(cand):
      hops += 1
      if hops > limit:
        return None
      target = os.readlink(cand)
      links[cand] = target
      if target.startswith("/"):
        cur = "/"
      todo = [c for c in target.split("/") if c] + todo
      continue
    if not os.path.lexists(cand):
      return None
    cur = cand
  return cur


def _elf_interpreter(path: str) -> str | None:
  """PT_INTERP of an ELF file (its dynamic loader), or None."""
  import struct  # pylint: disable=g-import-not-at-top
  try:
    with open(path, "rb") as f:
      head = f.read(64)
      if head[:4] != b"\x7fELF":
        return None
      is64, little = head[4] == 2, head[5] == 1
      e = "<" if little else ">"
      if is64:
        phoff, = struct.unpack(e + "Q", head[32:40])
        phentsize, phnum = struct.unpack(e + "HH", head[54:58])
      else:
        phoff, = struct.unpack(e + "I", head[28:32])
        phentsize, phnum = struct.unpack(e + "HH", head[42:46])
      for i in range(phnum):
        f.seek(phoff + i * phentsize)
        ph = f.read(phentsize)
        p_type, = struct.unpack(e + "I", ph[:4])
        if p_type != 3:  # PT_INTERP
          continue
        if is64:
          offset, = struct.unpack(e + "Q", ph[8:16])
          size, = struct.unpack(e + "Q", ph[32:40])
        else:
          offset, = struct.unpack(e + "I", ph[4:8])
          size, = struct.unpack(e + "I", ph[16:20])
        f.seek(offset)
        return f.read(size).rstrip(b"\0").decode()
  except (OSError, struct.error, UnicodeDecodeError):
    return None
  return None


def _shared_libraries(loader: str, elf: str) -> list[str]:
  """The shared libraries ``elf`` loads, as the dynamic loader finds them
  (``<loader> --list``, what ``ldd`` runs; the file is not executed)."""
  try:
    out = subprocess.run([loader, "--list", elf], capture_output=True, text=True,
                         timeout=60, env={"LC_ALL": "C"}).stdout
  except (OSError, subprocess.SubprocessError):
    return []
  libs = []
  for line in out.splitlines():
    line = line.strip()
    if "=>" in line:
      target = line.split("=>", 1)[1].strip().split(" (", 1)[0].strip()
      if target.startswith("/"):
        libs.append(target)
    elif line.startswith("/"):
      libs.append(line.split(" (", 1)[0].strip())
  return libs


_EXPOSURE_CACHE: dict = {}


def _interpreter_exposure(python: str, tools: tuple[str, ...]
                          ) -> tuple[list[str], dict[str, str], list[str]]:
  """What a run of ``python`` needs from the host: ``(binds, links, notes)``.

  ``binds`` are canonical paths bound read-only: the interpreter binary, its
  standard library directory (``lib-dynload`` included) and every shared
  library that the binary and the standard library's extension modules load
  (found by the dynamic loader's ``--list``), the ``tools`` and their
  libraries, and ``SYSTEM_PATHS``. ``links`` are the symlinks on the way
  (recreated). Cached per interpreter and tool list.
  """
  key = (os.path.realpath(python), os.path.abspath(python), tuple(tools))
  if key in _EXPOSURE_CACHE:
    return _EXPOSURE_CACHE[key]
  links: dict[str, str] = {}
  binds: set[str] = set()
  notes: list[str] = []
  try:
    info = subprocess.run(
        [python, "-I", "-c", "import os, sysconfig; print(os.path.dirname(os.__file__)); "
         "print(sysconfig.get_config_var('DESTSHARED') or '')"],
        capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    stdlib, dynload = info[0].strip(), info[1].strip()
  except (OSError, subprocess.SubprocessError, IndexError) as e:
    raise SandboxError(f"cannot ask the interpreter {python!r} where its standard "
                       f"library is: {e}") from None
  real_python = _resolve(python, links)
  if real_python is None:
    raise SandboxError(f"the interpreter {python!r} does not exist")
  binds.add(real_python)
  for d in (stdlib, dynload):
    real = _resolve(d, links) if d else None
    if real and not any(_under(real, b) for b in binds):
      binds.add(real)
  elves = [real_python]
  if dynload and os.path.isdir(dynload):
    elves += sorted(os.path.join(dynload, f) for f in os.listdir(dynload)
                    if f.endswith(".so"))
  for tool in tools:
    found = shutil.which(tool, path=_TOOL_PATH)
    if found is None:
      notes.append(f"tool {tool!r} is not installed")
      continue
    for named in {found, f"/bin/{tool}"} if tool == "sh" else {found}:
      real = _resolve(named, links)
      if real:
        binds.add(real)
        elves.append(real)
  loader = _elf_interpreter(real_python)
  if loader:
    libs = {loader}
    for elf in elves:
      libs.update(_shared_libraries(loader, elf))
    for lib in sorted(libs):
      real = _resolve(lib, links)
      if real:
        binds.add(real)
  else:
    notes.append(f"{real_python} has no dynamic loader (static): no libraries to add")
  for p in SYSTEM_PATHS:
    real = _resolve(p, links)
    if real:
      binds.add(real)
  # A file inside a bound directory needs no bind of its own.
  dirs = sorted(b for b in binds if os.path.isdir(b))
  out = sorted(b for b in binds if not any(b != d and _under(b, d) for d in dirs))
  # Links whose location is inside a bound directory exist there already.
  links = {k: v for k, v in links.items() if not any(_under(k, d) for d in dirs)}
  _EXPOSURE_CACHE[key] = (out, links, notes)
  return out, links, notes


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


def _run_and_reap(cmd, env, root, out_path, err_path, wall_s, *, namespaces: bool, uid):
  """Run the child with stdin/stdout/stderr files under ``root``, kill it (and its
  namespace or its uid's processes) after ``wall_s``; (timed out, return code)."""
  timed_out = False
  with open(os.path.join(root, "stdin"), "rb") as fin, \
      open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
    proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr,
                            env=env, cwd=root, start_new_session=True,
                            close_fds=True)
    try:
      proc.wait(timeout=wall_s)
    except subprocess.TimeoutExpired:
      timed_out = True
      if namespaces:
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
      rc = proc.wait()
      if uid is not None:
        kill_uid(uid)
  return timed_out, rc


def _status(rc, timed_out: bool, stderr: str) -> str:
  """The run's outcome from its return code and stderr."""
  if timed_out or rc in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
    return "timeout"
  if rc in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or (
      rc != 0 and "File too large" in stderr):  # Python ignores SIGXFSZ
    return "output_limit"
  if rc != 0 and "MemoryError" in stderr:
    return "memory"
  return "runtime_error" if rc != 0 else "ok"


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
    tools: programs on ``PATH`` a run may start besides its interpreter
      (each with its shared libraries); default a shell, ``echo``, ``cat``
      and ``sleep``. ``()``: the interpreter only.
    seccomp: install the seccomp filter (no new namespaces, no mounts) where
      this architecture is supported (x86_64, aarch64).
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
      tools: tuple[str, ...] = DEFAULT_TOOLS,
      seccomp: bool = True,
  ):
    if isolation not in ("auto", "namespaces", "none"):
      raise ValueError(f"isolation must be auto|namespaces|none: {isolation!r}")
    self.limits = limits
    self.python = python
    self.isolation = isolation
    self.uid_base = uid_base
    self.python_guard = python_guard
    self.tools = tuple(tools)
    self.seccomp = bool(seccomp)
    self._is_root = os.geteuid() == 0
    self._slots = threading.BoundedSemaphore(max_concurrency)
    self._free = list(range(max_concurrency))
    self._lock = threading.Lock()  # guards the free-slot list
    self._probe_lock = threading.Lock()
    self._caps: dict[str, Any] | None = None
    self._probe_error: str | None = None
    self._exposed: list[str] | None = None
    self._exposed_links: dict[str, str] = {}

  # -- capabilities --------------------------------------------------------

  def capabilities(self) -> dict[str, Any]:
    """Which isolation layers are active here (probes once, then cached).

    Returns a dict with keys: ``namespaces`` (net+pid+mount), ``read_only_fs``
    (the minimal root filesystem), ``drop_uid`` (root trainer runs programs
    under another uid), ``nproc_enforced``, ``python_guard``, ``seccomp`` (the
    filter that denies new namespaces and mounts), ``prefix`` (the unshare
    command), and ``notes`` (why a layer is off).

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
    seccomp = self.seccomp and seccomp_supported()
    if self.seccomp and not seccomp:
      notes.append("no seccomp filter: unknown syscall numbers on this architecture")
    if self.isolation != "none":  # "none" shows the whole host on purpose
      self._check_protected()
    hidden = self._probe_host_paths()
    probe = _PROBE_PROGRAM.format(host_paths=hidden)
    for prefix in options:
      for drop in ([True, False] if self._is_root else [False]):
        for filt in ([True, False] if seccomp else [False]):
          caps = {"namespaces": prefix is not None, "read_only_fs": prefix is not None,
                  "drop_uid": drop, "prefix": prefix, "seccomp": filt,
                  "python_guard": self.python_guard}
          caps["nproc_enforced"] = drop or not self._is_root
          self._caps = caps
          try:
            res = self._run(caps, probe, "", SandboxLimits(wall_s=20))
            lines = res.stdout.splitlines()
            visible = [ln.split(" ", 1)[1] for ln in lines if ln.startswith("visible ")]
            if lines[:1] == ["ok"] and prefix is not None and visible:
              notes.append(f"probe prefix={prefix}: host paths are visible inside "
                           f"the sandbox: {visible}")  # fail closed
            elif lines[:1] == ["ok"] and filt and "unshare-denied" not in lines:
              notes.append("probe: the seccomp filter did not deny unshare")  # fail closed
            elif lines[:1] == ["ok"]:
              caps["notes"] = notes
              if prefix is None:
                logging.warning("code sandbox: running WITHOUT namespaces "
                                "(isolation=%r; no OS-level network/filesystem "
                                "isolation): %s", self.isolation, notes)
              if self._is_root and not drop:
                logging.warning("code sandbox: cannot switch to an unprivileged "
                                "uid; RLIMIT_NPROC is not enforced: %s", notes)
              if seccomp and not filt:
                logging.warning("code sandbox: the seccomp filter could not be "
                                "installed; new namespaces are not denied: %s", notes)
              return caps
            else:
              notes.append(f"probe prefix={prefix} drop_uid={drop} seccomp={filt}: "
                           f"{res.status} {res.stderr[-300:]!r}")
          except SandboxError as e:
            notes.append(f"probe prefix={prefix} drop_uid={drop} seccomp={filt}: {e}")
          finally:
            self._caps = None
    if self.isolation == "namespaces":
      raise SandboxError(
          "the code sandbox needs Linux namespaces (net, pid, mount) and a "
          "private root filesystem that hides the host, which this host does "
          "not allow, so it refuses to run untrusted code unconfined. Allow "
          "unprivileged user namespaces (or run the trainer as root), or pass "
          f"Sandbox(isolation='none') for trusted code only. Details: {notes}")
    raise SandboxError(f"the sandbox cannot run a trivial program: {notes}")

  def _probe_host_paths(self) -> list[str]:
    """Host paths that must be invisible inside: a few files of /etc, this
    file, one file of /usr that is not exposed, and every protected path
    (datasets, the workdir; ``protect_path``) that is not a directory on the
    way to something exposed."""
    exposed = self._expose()
    reach = exposed + list(self._links()) + [tempfile.gettempdir()]
    out = []
    for p in (_PROBE_HOST_FILES + (os.path.abspath(__file__), "/usr/share", "/usr/local")
              + tuple(protected_paths())):
      if (os.path.lexists(p) and not any(_under(p, q) for q in exposed)
          and not any(_under(q, p) for q in reach)):  # not a directory on the way
        out.append(p)
    return list(dict.fromkeys(out)) or ["/etc"]  # /etc: never exposed

  def _check_protected(self) -> None:
    """Fails closed when a protected path (``protect_path``: a dataset or the
    workdir) lies inside what a run sees."""
    exposed = self._expose()
    for p in protected_paths():
      for q in exposed:
        if _under(p, q):
          raise SandboxError(
              f"the code sandbox would let programs read {p} (a protected dataset or "
              f"workdir path): it lies in {q}, which the interpreter {self.python} "
              "needs inside the sandbox; move the data or the workdir elsewhere")

  def _expose(self) -> list[str]:
    """Canonical host paths bound read-only into a run's minimal root."""
    if self._exposed is None:
      binds, links, notes = _interpreter_exposure(self.python, self.tools)
      if notes:
        from absl import logging  # pylint: disable=g-import-not-at-top
        logging.info("code sandbox exposure: %s", notes)
      self._exposed, self._exposed_links = binds, links
    return list(self._exposed)

  def _links(self) -> dict[str, str]:
    """Symlinks recreated in the minimal root (the interpreter as named, e.g.
    a venv's bin/python, and the links on the way to every exposed path)."""
    self._expose()
    return dict(self._exposed_links)

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
    if caps["read_only_fs"]:
      self._check_protected()  # paths may be declared after the probe
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
          "nofile": limits.max_open_files, "seccomp": caps.get("seccomp", False),
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
      timed_out, rc_after = _run_and_reap(cmd, env, root, out_path, err_path, limits.wall_s,
                                          namespaces=caps["namespaces"],
                                          uid=uid if not caps["namespaces"] else None)
      wall = time.monotonic() - t0
      rc = None if timed_out else rc_after
      stdout, _ = _read_tail(out_path, limits.max_output_bytes)
      stderr, _ = _read_tail(err_path, limits.max_output_bytes)
      if rc == SETUP_FAILED_EXIT and SETUP_FAILED_MARK in stderr:
        raise SandboxError(stderr.strip()[-1000:])
      status = _status(rc, timed_out, stderr)
      return RunResult(status, rc, stdout, stderr, wall)
    finally:
      shutil.rmtree(root, ignore_errors=True)


