"""Write the shipped chat and tool-call conversations (slimwise_train/assets/data/; slimwise_train/data/tool_chats.py).

    python scripts/make_tool_chats.py                 # regenerate the shipped files (byte for byte the same)
    python scripts/make_tool_chats.py --out /tmp/x    # somewhere else
"""

from __future__ import annotations

import argparse

from slimwise_train.data.tool_chats import ASSETS, write_tool_chats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ASSETS), help="folder to write into (default: the shipped assets)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the suite's problems and of the tool results")
    args = parser.parse_args()
    for path in write_tool_chats(args.out, args.seed):
        print(f"{path}: {path.stat().st_size / 1024:.1f} KiB, {sum(1 for _ in path.open())} rows")


if __name__ == "__main__":
    main()
