"""`python -m slimwise_train.prune` and `torchrun ... -m slimwise_train.prune` (the app lives in app.py)."""

from slimwise_train.prune.app import main
from slimwise_train.utils import distributed as du

if __name__ == "__main__":
    try:
        main()
    finally:
        du.shutdown()
