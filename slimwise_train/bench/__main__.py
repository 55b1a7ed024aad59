"""`python -m slimwise_train.bench <name>`."""

import sys

from slimwise_train.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
