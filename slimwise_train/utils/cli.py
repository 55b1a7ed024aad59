"""What every `python -m slimwise_train.<app>` entry point shares: one-line errors for bad input."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Iterator

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, KeyError)


def _report_to_torchrun(line: str) -> None:
    # torchrun ends with a "Root Cause" block read from this file: put the one clear line there, instead of
    # "error_file: <N/A>" and a pointer to the elastic docs, so it is what the user reads last.
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    with contextlib.suppress(OSError):
        with open(path, "w") as handle:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, handle)


@contextlib.contextmanager
def user_errors(prog: str) -> Iterator[None]:
    """Turn a user error into `<prog>: error: <message>` on stderr and exit code 2 (no traceback).

    Under torchrun only rank 0 prints it (every rank hits the same bad input); the others exit quietly with the
    same code."""
    try:
        yield
    except USER_ERRORS as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        line = f"{prog}: error: {message}"
        if int(os.environ.get("RANK", "0")) == 0:
            print(line, file=sys.stderr)
        _report_to_torchrun(line)  # also from other ranks: an error only rank 1 hits still reaches the user
        raise SystemExit(2) from None
