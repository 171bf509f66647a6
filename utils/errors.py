"""The one base class of errors a user causes and can fix, and how ``main.py`` reports them.

``main.py`` prints any ``UserError`` as one line, ``error: <message>``, and exits non-zero
(the traceback only at ``logging.level = DEBUG``). Messages read
``<what>: <value>: <how to fix>``: the field, path or file; the bad value; the rule or the fix.
Subclasses keep their historical builtin bases (``ValueError``, ``RuntimeError``) so existing
``except`` clauses still catch them.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn


class UserError(Exception):
    """Raised for bad input (config, data, model directory, tokenizer, checkpoint, workdir)."""


class MissingFileError(UserError, FileNotFoundError):
    """A file the run reads (tokenizer.json, a model's config.json) is absent; names it."""


def one_line(error: BaseException) -> str:
    """``error``'s message on one line (a message quoting another library's error may wrap)."""
    return " ".join(str(error).split())


# Orbax restores through a private event loop that it closes as soon as one array fails (a
# checkpoint that does not fit the run): tensorstore reads still in flight then report "Event loop
# is closed" from their completion callbacks, and the orphaned read coroutines raise again when
# they are finalised, at the latest during interpreter shutdown, after the error line. None of it
# says more than the user's error.
_SHUTDOWN_NOISE = ((RuntimeError, "Event loop is closed"),
                   (ImportError, "Python is likely shutting down"))
_exit = {"reported": False, "verbose": False}


def quiet_shutdown_noise(verbose: Callable[[], bool] = lambda: False) -> None:
    """Keep unraisable exceptions that only report a closed event loop or interpreter shutdown
    off stderr and, once ``exit_on_user_error`` has reported, every unraisable exception of the
    failed work's teardown; all others go to the default hook. ``verbose()`` true (the config's
    ``logging.level = DEBUG``) keeps them all."""
    default = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if _exit["reported"]:
            if not _exit["verbose"]:
                return
        elif not verbose() and any(isinstance(unraisable.exc_value, t) and text in
                                   str(unraisable.exc_value) for t, text in _SHUTDOWN_NOISE):
            return
        default(unraisable)

    sys.unraisablehook = hook


def exit_on_user_error(error: UserError, *, verbose: bool) -> NoReturn:
    """Print the traceback when ``verbose``, then ``error: <message>`` on one line, and exit 1.
    An error whose class sets ``hard_exit`` (work left in threads that never finish) ends the
    process without waiting for them."""
    if verbose:
        traceback.print_exception(error)
    _exit.update(reported=True, verbose=verbose)
    if getattr(error, "hard_exit", False):
        print(f"error: {one_line(error)}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        logging.shutdown()
        os._exit(1)
    sys.exit(f"error: {one_line(error)}")
