"""The one base class of errors a user causes and can fix.

``main.py`` prints any ``UserError`` as one line, ``error: <message>``, and exits non-zero
(the traceback only at ``logging.level = DEBUG``). Messages read
``<what>: <value>: <how to fix>``: the field, path or file; the bad value; the rule or the fix.
Subclasses keep their historical builtin bases (``ValueError``, ``RuntimeError``) so existing
``except`` clauses still catch them.
"""

from __future__ import annotations


class UserError(Exception):
    """Raised for bad input (config, data, model directory, tokenizer, checkpoint, workdir)."""
