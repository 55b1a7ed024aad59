"""`python -m slimwise_train` and `torchrun ... -m slimwise_train`: the distillation trainer (distill/app.py)."""

from slimwise_train.distill.app import main
from slimwise_train.utils import distributed as du

if __name__ == "__main__":
    try:
        main()
    finally:
        # After every multirun job: gc, barrier, destroy (a gloo group torn down earlier breaks the next job).
        du.shutdown()
