"""Console and log-file setup for the launchers.

``setup_logging(workdir)`` makes a run's console readable and keeps everything:

* the full Python / absl log (INFO and up, DEBUG with ``verbosity="debug"``)
  goes to ``WORKDIR/log.txt`` (appended, so a resumed run adds to it);
* the console shows WARNING and up by default, so orbax's and absl's INFO lines
  no longer interleave with the progress bars; ``verbosity="info"`` (or an
  absl-style integer, ``0`` = INFO, ``1`` = DEBUG) brings them back;
* Python ``warnings`` are routed into the same log;
* the workdir is declared to the code sandbox (``sandbox.protect_path``), which
  refuses to run programs that could see it.

Call it once at start-up, after flags are parsed (``verbosity`` from a
``--verbosity``-style flag), e.g. in ``launch/train.py``'s ``main``::

  console.setup_logging(FLAGS.workdir, verbosity=FLAGS.console_verbosity)

Only the console handlers it finds (absl's stderr handler, plain stream
handlers on stdout/stderr) change level; other handlers (e.g. pytest's
capture) are left alone. ``teardown_logging()`` removes what it added.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import IO, Optional, Union

_NAMES = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "warn": logging.WARNING, "error": logging.ERROR, "fatal": logging.CRITICAL,
          "critical": logging.CRITICAL}
_MARK = "_fbos_console"  # attribute set on the handlers this module adds
LOG_FILE = "log.txt"
_saved_levels: dict = {}  # handler -> level before setup_logging changed it


def parse_verbosity(verbosity: Union[str, int]) -> int:
  """A Python logging level from a name ("warning", "info", "debug", ...) or
  an absl-style integer (-1 WARNING, 0 INFO, >= 1 DEBUG; -2 ERROR)."""
  if isinstance(verbosity, bool):
    raise ValueError(f"verbosity must be a level name or an integer: {verbosity!r}")
  if isinstance(verbosity, int) or (isinstance(verbosity, str)
                                    and verbosity.lstrip("-").isdigit()):
    v = int(verbosity)
    return {-1: logging.WARNING, 0: logging.INFO}.get(
        v, logging.DEBUG if v > 0 else logging.ERROR)
  name = str(verbosity).strip().lower()
  if name not in _NAMES:
    raise ValueError(f"verbosity must be one of {sorted(_NAMES)} or an absl-style "
                     f"integer, got {verbosity!r}")
  return _NAMES[name]


def _console_handlers(root: logging.Logger) -> list[logging.Handler]:
  """Handlers on ``root`` that print to the terminal."""
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  absl_handler = absl_logging.get_absl_handler()
  out = []
  for h in root.handlers:
    if getattr(h, _MARK, None) == "file":
      continue
    if h is absl_handler or getattr(h, _MARK, None) == "console":
      out.append(h)
    elif (type(h) is logging.StreamHandler  # pylint: disable=unidiomatic-typecheck
          and getattr(h, "stream", None) in (sys.stderr, sys.stdout,
                                              sys.__stderr__, sys.__stdout__)):
      out.append(h)
  return out


class _LogFile(logging.FileHandler):
  """``log.txt``: a write that fails with an OSError (a full disk) ends the file log
  with one line on stderr, instead of a "--- Logging error ---" traceback for every
  record after it (thousands of lines, burying the run's real error)."""

  failed = False

  def handleError(self, record):
    e = sys.exc_info()[1]
    if not isinstance(e, OSError):
      return super().handleError(record)
    if not self.failed:
      self.failed = True
      self.setLevel(logging.CRITICAL + 1)
      sys.stderr.write(f"{self.baseFilename} can no longer be written ({type(e).__name__}: "
                       f"{e}); the log goes to the console only from here\n")


def setup_logging(workdir: str, *, verbosity: Union[str, int] = "warning",
                  console_stream: Optional[IO[str]] = None,
                  filename: str = LOG_FILE) -> str:
  """Full log to ``workdir/filename``, console at ``verbosity``; idempotent.

  Args:
    workdir: the run's directory (created if needed).
    verbosity: console level: a name or an absl-style integer (see
      ``parse_verbosity``). The file gets INFO and up, or this level when
      it is lower (DEBUG).
    console_stream: print the console log here (a stream handler of this
      module's own); default: keep the console handlers already installed
      (absl's under ``app.run``), or add one on stderr when there is none.
    filename: the log file's name in ``workdir``.

  Returns:
    The log file's path.
  """
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top

  console_level = parse_verbosity(verbosity)
  file_level = min(logging.INFO, console_level)
  teardown_logging()
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, filename)
  root = logging.getLogger()
  file_handler = _LogFile(path, mode="a", encoding="utf-8")
  file_handler.setLevel(file_level)
  file_handler.setFormatter(logging.Formatter(
      "%(asctime)s %(levelname).1s %(name)s %(filename)s:%(lineno)d] %(message)s"))
  setattr(file_handler, _MARK, "file")
  root.addHandler(file_handler)
  consoles = _console_handlers(root)
  if console_stream is not None or not consoles:
    for h in consoles:  # replaced by ours: do not print twice
      _set_level(h, logging.CRITICAL + 1)
    own = logging.StreamHandler(console_stream or sys.stderr)
    own.setFormatter(logging.Formatter("%(levelname).1s %(name)s] %(message)s"))
    setattr(own, _MARK, "console")
    root.addHandler(own)
    own.setLevel(console_level)
  else:
    for h in consoles:
      _set_level(h, console_level)
  # Let records through the loggers; the handlers decide where they show.
  if root.level > file_level:
    root.setLevel(file_level)
  absl_logging.get_absl_logger().setLevel(file_level)
  absl_logging.set_verbosity(
      {logging.DEBUG: absl_logging.DEBUG}.get(file_level, absl_logging.INFO))
  logging.captureWarnings(True)
  # The workdir holds checkpoints, logs and the data state: the code sandbox
  # must never show it to the programs it runs (it refuses to run otherwise).
  from fbos_jax.verifiers import sandbox  # pylint: disable=g-import-not-at-top
  sandbox.protect_path(workdir)
  return path


def _set_level(handler: logging.Handler, level: int) -> None:
  _saved_levels.setdefault(handler, handler.level)
  handler.setLevel(level)


def write_to_log_file(text: str) -> None:
  """Append ``text`` to the log file(s) of :func:`setup_logging` as is (a traceback
  the process prints on its way out); a write that fails (a full disk) is skipped."""
  for h in logging.getLogger().handlers:
    if getattr(h, _MARK, None) == "file" and not getattr(h, "failed", False):
      try:
        h.stream.write(text)
        h.flush()
      except (AttributeError, OSError, ValueError):
        pass


def flush() -> None:
  """Flushes this module's handlers (e.g. before reading ``log.txt``)."""
  for h in logging.getLogger().handlers:
    if getattr(h, _MARK, None):
      h.flush()


def teardown_logging() -> None:
  """Removes and closes the handlers ``setup_logging`` added and restores the
  levels of the console handlers it changed."""
  root = logging.getLogger()
  for h in list(root.handlers):
    if getattr(h, _MARK, None):
      root.removeHandler(h)
      h.close()
  for h, level in _saved_levels.items():
    h.setLevel(level)
  _saved_levels.clear()
