"""`python -m slimwise_train.eval` and `torchrun ... -m slimwise_train.eval` (the app lives in app.py)."""

from slimwise_train.eval.app import main
from slimwise_train.utils import distributed as du

if __name__ == "__main__":
    try:
        main()
    finally:
        du.shutdown()
