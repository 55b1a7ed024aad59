"""Each benchmark subcommand runs on a tiny config and prints one JSON line with its ratio."""

from __future__ import annotations

import json

import pytest

from slimwise_train.bench import BENCHES, main

TINY = ["--hidden", "32", "--layers", "2", "--experts", "8", "--top-k", "2", "--moe-intermediate", "16",
        "--vocab", "64", "--batch", "2", "--seq", "16", "--repeats", "2"]


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_bench_subcommand_prints_one_json_line(name, capsys):
    assert main([name, *TINY]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["bench"] == name
    assert result["ratio"] > 0
