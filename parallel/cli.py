"""What the two commands (``python -m parallel.train``, ``python -m parallel.launch``) share: the user's mistakes
as one ``error:`` line and exit status 2, and an argument parser that makes them so.

A mistake in the user's input is a ``UsageError``; ``main`` prints it and returns 2. The package's functions
raise ``TypeError``/``ValueError`` naming their arguments (``lr``, ``data_dir``), most as ``BadValue``/``BadType``
(``parallel.validate``), which carry the names as data; where the command passed the user's input straight to
them, ``users_input`` turns those errors into ``UsageError`` naming the command's flags instead (``--lr``,
``--data-dir``; ``flag_message`` for an error that names its argument only at its start). Anywhere else a
``ValueError`` is a bug in the package, and shows its traceback. Nothing here imports MXNet.

>>> flag_message("lr must be a finite number > 0, got -1.0", {"lr": "--lr"})
'--lr must be a finite number > 0, got -1.0'
"""
import argparse
import contextlib
import math
import re

from .validate import BadType, BadValue

__all__ = ["UsageError", "Parser", "flag_message", "users_input", "finite_float", "positive_float",
           "warning_lines", "RESTART_ENV", "JOB_ENV", "HOSTS_ENV", "PROGRESS_ENV", "shows_progress", "USAGE_STATUS",
           "restart_count", "launched", "job_hosts"]

#: The exit status of a command given input that cannot work. ``python -m parallel.launch --max-restarts`` does
#: not restart a job whose worker exited with it: the same input would fail the same way again.
USAGE_STATUS = 2

#: The environment variable ``python -m parallel.launch`` sets for every process of a job: 0 on its first start,
#: r on its r-th restart. ``python -m parallel.train`` resumes from its ``--checkpoint-dir`` when it is >= 1.
RESTART_ENV = "PARALLEL_RESTART"

#: The environment variable ``python -m parallel.launch`` sets for every process of a job, the same at every
#: start: a token of that launch. A restarted ``python -m parallel.train`` takes over its ``--checkpoint-dir``
#: from a process of an earlier start of the same job (one cut off on a partitioned host still holds it).
JOB_ENV = "PARALLEL_JOB"

#: The environment variable ``python -m parallel.launch`` sets for every process of a job: how many distinct hosts
#: its servers and workers run on, where its gradients travel (1 with ``--launcher local``). ``python -m parallel.train`` sizes its
#: buckets for a network link when it is 2 or more.
HOSTS_ENV = "PARALLEL_HOSTS"

#: The environment variable ``python -m parallel.launch`` sets for every process of a job: 1 when its own stderr
#: is a terminal, where it draws the job's one progress display (rank 0's bar), else 0: no worker draws one.
PROGRESS_ENV = "PARALLEL_PROGRESS"


def shows_progress(no_progress, main_rank):
    """Whether this process draws progress bars: unless ``--no-progress``; in a job rank 0 alone (``main_rank``),
    and only when the launcher's output is a terminal (``PROGRESS_ENV``).

    >>> import os
    >>> shows_progress(False, True) == (not launched() or os.environ.get(PROGRESS_ENV) == "1")
    True
    >>> shows_progress(True, True), shows_progress(False, False)
    (False, False)
    """
    import os
    return not no_progress and main_rank and (not launched() or os.environ.get(PROGRESS_ENV) == "1")


def restart_count(environ=None):
    """Which restart of its job this process belongs to (``RESTART_ENV``): 0 for a first start or a process no
    launcher started.

    >>> restart_count({}), restart_count({"PARALLEL_RESTART": "2"}), restart_count({"PARALLEL_RESTART": "x"})
    (0, 2, 0)
    """
    found = _env_count(RESTART_ENV, environ)
    return 0 if found is None else found


def _env_count(name, environ=None):
    """The whole number the launcher set in ``name`` of ``environ`` (default this process's), or None."""
    import os
    value = (os.environ if environ is None else environ).get(name, "").strip()
    return int(value) if value.isdigit() else None


def job_hosts(environ=None):
    """On how many hosts this process's job runs (``HOSTS_ENV``): 1 for a process no launcher started.

    >>> job_hosts({}), job_hosts({"PARALLEL_HOSTS": "3"}), job_hosts({"PARALLEL_HOSTS": "0"})
    (1, 3, 1)
    """
    found = _env_count(HOSTS_ENV, environ)
    return 1 if found is None else max(1, found)


def launched(environ=None):
    """Whether this process is a worker that ``python -m parallel.launch`` started (a distributed job).

    >>> launched({"DMLC_ROLE": "worker"}), launched({"DMLC_ROLE": "server"}), launched({})
    (True, False, False)
    """
    import os
    return (os.environ if environ is None else environ).get("DMLC_ROLE") == "worker"


class UsageError(Exception):
    """Input the user controls cannot work; the command prints the message on one line and exits with 2.

    Deliberately not a ``ValueError``: a ``ValueError`` escaping from the package's own code is a bug and
    must show its traceback, not pass for the user's mistake.
    """


class Parser(argparse.ArgumentParser):
    """``argparse`` with one-line errors (raised as ``UsageError``, no usage dump) and no abbreviations: a
    prefix such as ``--epoch`` is refused, not taken for ``--epochs``.

    Attributes
    ----------
    options : list of argparse.Action
        Every argument ``add_argument`` added, ``-h`` first, in order: what a command offers (its flags, their
        choices, defaults and help), for documentation and tests to read without argparse's private fields.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        self.options = []   # before argparse's own __init__, which adds -h
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        """``argparse``'s ``add_argument``; the action it returns is listed in ``options`` too."""
        action = super().add_argument(*args, **kwargs)
        self.options.append(action)
        return action

    def option(self, dest):
        """The argument stored as ``dest`` (``"model"`` for ``--model``); ``KeyError`` naming it if there is none."""
        for action in self.options:
            if action.dest == dest:
                return action
        raise KeyError(f"{self.prog} has no argument {dest!r}")

    def error(self, message):
        # a type's refusal ("argument --lr: must be ...") in the words of the flags' own checks: "--lr must be ..."
        match = re.fullmatch(r"argument (-[^\s:/]+)(?:/\S+)?: (must .*)", message, re.DOTALL)
        raise UsageError(f"{match.group(1)} {match.group(2)}" if match else message)


def _number(text, positive):
    """``text`` as a finite float (> 0 if ``positive``), refused in the words the flags' own range checks use
    (``parallel.validate.check_number``), the value shown as a float when it is one: ``Parser`` puts the flag
    first, so every bad value of a flag reads alike."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or (positive and not value > 0):
        given = repr(text) if value is None else repr(value)
        raise argparse.ArgumentTypeError(f"must be a finite number{' > 0' if positive else ''}, got {given}")
    return value


def finite_float(text):
    """An ``argparse`` type: a finite float (``--wd nan``: ``--wd must be a finite number, got nan``)."""
    return _number(text, positive=False)


def positive_float(text):
    """An ``argparse`` type: a finite float > 0, every other value refused alike (``--bucket-mb 0``, ``nan`` or
    ``x``: ``--bucket-mb must be a finite number > 0, got 0.0``, ``nan``, ``'x'``)."""
    return _number(text, positive=True)


def flag_message(message, flags):
    """``message`` with the argument name it starts with replaced by the command's flag for it (``flags``
    maps names to flags); unchanged when it starts with no name in ``flags``."""
    match = re.match(r"(\w+)\b", message)
    if match and match.group(1) in flags:
        return flags[match.group(1)] + message[match.end():]
    return message


@contextlib.contextmanager
def users_input(*errors, flags=None):
    """Turn ``errors`` raised inside the block, which can only come from the user's input, into ``UsageError``
    (the message's argument name mapped to the flag, see ``flag_message``)."""
    try:
        yield
    except errors as e:
        rendered = isinstance(e, (BadValue, BadType))   # the package's argument errors name flags themselves
        raise UsageError(e.render(flags or {}) if rendered else flag_message(str(e), flags or {})) from None


@contextlib.contextmanager
def warning_lines(stream=None):
    r"""Inside the block, print each warning the package (or MXNet) issues as one ``warning: ...`` line on
    ``stream`` (stderr), as the command's own warnings read: no category, file name or source line. Which
    warnings show stays Python's filters' choice; both are restored on leaving.

    >>> import io, warnings
    >>> out = io.StringIO()
    >>> with warning_lines(out):
    ...     warnings.warn("the residuals were dropped:\none context compresses nothing")
    >>> out.getvalue()
    'warning: the residuals were dropped: one context compresses nothing\n'
    """
    import sys
    import warnings

    def show(message, category, filename, lineno, file=None, line=None):
        text = " ".join(str(message).split())
        print(f"warning: {text}", file=stream or sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield
