"""`python -m slimwise_train.data show [key=value ...]` (the app lives in app.py; `show --help` explains every key)."""

import sys

COMMANDS = ("show",)

if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m slimwise_train.data show [key=value ...] [--help]\n\n"
              "show: the first sequences of data.source as a run trains on them, supervised tokens marked, and the "
              "counts (python -m slimwise_train.data show --help explains every key)")
        sys.exit(0 if args else 2)
    if args[0] not in COMMANDS:
        print(f"slimwise_train.data: error: unknown command {args[0]!r}; use one of: {', '.join(COMMANDS)} "
              "(python -m slimwise_train.data show --help)", file=sys.stderr)
        sys.exit(2)
    sys.argv = [f"{sys.argv[0]} {args[0]}", *args[1:]]
    from slimwise_train.data.app import main  # after the command is known: a bad one is refused at once

    main()
