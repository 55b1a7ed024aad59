"""What every `python -m slimwise_train.<app>` entry point shares: one-line errors for bad input."""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, KeyError)


@contextlib.contextmanager
def user_errors(prog: str) -> Iterator[None]:
    """Turn a user error into `<prog>: error: <message>` on stderr and exit code 2 (no traceback)."""
    try:
        yield
    except USER_ERRORS as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"{prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
