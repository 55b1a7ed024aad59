"""`python -m slimwise_train.plan` (the app lives in app.py)."""

from slimwise_train.plan.app import main

if __name__ == "__main__":
    main()
