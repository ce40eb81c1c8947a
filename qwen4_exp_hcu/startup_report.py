"""Repeat the root cause of a failed vLLM engine as the last line the user sees.

vLLM runs its engine core and workers in child processes. When one fails (a missing checkpoint tensor, a
setting the model cannot honour), vLLM logs the traceback there, and the front-end dies 100+ lines later
with `Engine core initialization failed. See root cause above.` The plugin runs in every process: the
front-end names a report file for each engine it starts (in an environment variable its engine processes
inherit), the first exception vLLM logs in any of them is written there as one line, and the front-end logs
that line once more after its own traceback when it dies of it.
"""

import atexit
import itertools
import logging
import os
import sys
import tempfile

REPORT_ENV = "_QWEN4_EXP_HCU_START_REPORT"
"""Internal, not a setting: the report file of the engine start that made this process."""

logger = logging.getLogger("vllm.qwen4_exp_hcu")
_starts = itertools.count()
_reports: list[str] = []  # report files this process named as a front-end, removed at exit
_recorder: logging.Handler | None = None


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of an explicit `raise ... from` chain."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


class _FirstError(logging.Handler):
    """Writes the first exception vLLM logs in this engine (any of its processes) to the report file."""

    def __init__(self, path: str):
        super().__init__(logging.ERROR)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if not record.exc_info or record.exc_info[1] is None:
            return
        exc = root_cause(record.exc_info[1])
        line = " ".join(f"{type(exc).__name__}: {exc}".split())
        try:
            with open(self.path, "x") as f:  # "x": the first failing process of the engine wins
                f.write(f"{line} (process {os.getpid()})")
        except OSError:  # already reported, or no temp dir: never break vLLM's own logging
            pass


def watch_engine_process() -> None:
    """In a process an engine start made (the report variable inherited): record what vLLM logs failing."""
    global _recorder
    path = os.environ.get(REPORT_ENV)
    if path is None or _recorder is not None or path in _reports:
        return
    _recorder = _FirstError(path)
    logging.getLogger("vllm").addHandler(_recorder)


def new_engine_start() -> None:
    """In the process that builds a vLLM config, before it starts engine processes: a fresh report file for
    them, and the hook that repeats its line if this process dies of an uncaught exception."""
    global _recorder
    if _recorder is not None:  # an engine process of another front-end starting its own engine
        logging.getLogger("vllm").removeHandler(_recorder)
        _recorder = None
    path = os.path.join(tempfile.gettempdir(), f"qwen4_exp_hcu-start-{os.getpid()}-{next(_starts)}.txt")
    os.environ[REPORT_ENV] = path
    if not _reports:
        atexit.register(_remove_reports)
        sys.excepthook = _repeating_root_cause(sys.excepthook)
    _reports.append(path)


def _repeating_root_cause(previous):
    def hook(kind, value, traceback):
        previous(kind, value, traceback)
        try:
            with open(os.environ[REPORT_ENV]) as f:
                cause = f.read()
        except (KeyError, OSError):  # no engine process logged a failure
            return
        logger.error("Root cause, logged above by a vLLM engine process: %s", cause)

    return hook


def _remove_reports() -> None:
    for path in _reports:
        if os.path.exists(path):
            os.remove(path)
