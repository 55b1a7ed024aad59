"""`python -m slimwise_train.bench <name>`: a flag out of range is one line and exit 2 (`main` itself raises the
ValueError, for callers in Python)."""

import sys

from slimwise_train.bench.cli import main
from slimwise_train.utils.cli import user_errors

if __name__ == "__main__":
    with user_errors("python -m slimwise_train.bench"):
        sys.exit(main())
