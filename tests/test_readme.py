"""The README's code runs as written, from a checkout, leaving `git status` clean (everything under outputs/): the
tour in a fresh shell, and the Python block of "The library in five calls" after the tour's step 1 (the prune command
it names), in a process of its own as a user would paste it; the README's file tables and test count match what a
run writes and what pytest collects."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import checkout_like, shell_without_venv, untracked

pytestmark = pytest.mark.subprocess  # every block runs as a user pastes it: in a process of its own
REPO = Path(__file__).resolve().parents[1]


def readme_block(heading: str, language: str) -> str:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index(heading):]
    return re.search(rf"```{language}\n(.*?)```", section, re.S).group(1)


def test_the_library_in_five_calls_runs_as_written(tmp_path):
    checkout = checkout_like(tmp_path / "checkout")  # a clone's relative paths, its .gitignore
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    tour = readme_block("## A five-minute tour", "bash")
    prune = next(line for line in tour.splitlines() if line.startswith("python -m slimwise_train.prune"))
    proc = subprocess.run([sys.executable, *prune.split()[1:]], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    code = readme_block("## The library in five calls", "python")
    proc = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    texts, lengths = proc.stdout.strip().rsplit("] [", 1)
    assert "885" in texts and "40" in texts  # 6+916-37 and 12*3+4, answered by the pruned decoder
    assert (checkout / "outputs" / "decode_ckpt" / "config.json").is_file()
    assert (checkout / "outputs" / "decode_ckpt" / "slimwise_keep_set.json").is_file()
    assert untracked(checkout) == [], "the block left files outside outputs/"


# The counts the README's tour lets a user make small for a quick look, as it writes them: {written: shortened}.
QUICK_LOOK = {
    "experiment=demo": "experiment=demo distill.schedule.max_steps=20",
    "eval.student=outputs/train/teacher/reap-r0.5": "eval.student=outputs/train/teacher/reap-r0.5 eval.num_per_family=10",
    "--output_path outputs/lm_eval": "--output_path outputs/lm_eval --limit 10",
}


@pytest.mark.slow
def test_the_tour_runs_as_written_in_a_fresh_shell(tmp_path):
    """The tour's shell block as a user pastes it into a new shell (the venv not activated by the test: the block's
    own first line does it), from a checkout, with only the counts the README names made small: it runs, leaves
    `git status` clean (everything under outputs/), every stage writes what the README's table lists and nothing it
    does not, and the lm-eval loop's one report compares every mode against full."""
    import json

    readme = (REPO / "README.md").read_text()
    checkout = checkout_like(tmp_path / "checkout", venv=True)
    env = shell_without_venv()
    bare = subprocess.run(["bash", "-c", "command -v torchrun"], cwd=checkout, env=env, capture_output=True)
    assert bare.returncode != 0, "the test's shell must not have the venv on PATH already"
    tour = readme_block("## A five-minute tour", "bash")
    assert tour.startswith("source .venv/bin/activate")
    for (written, shortened), said in zip(QUICK_LOOK.items(), ("distill.schedule.max_steps=20",
                                                               "eval.num_per_family=10", "--limit 10")):
        assert f"`{said}`" in readme.split("## A five-minute tour", 1)[1].split("```", 1)[0], said  # the README says so
        assert tour.count(written) == 1, written
        tour = tour.replace(written, shortened)
    proc = subprocess.run(["bash", "-e", "-c", tour], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert untracked(checkout) == [], "the tour left files outside outputs/"
    out = checkout / "outputs"
    (eval_dir,) = (out / "eval" / "teacher").iterdir()
    (lm_dir,) = (out / "lm_eval").iterdir()
    assert lm_dir.name == "slimwise_train__assets__teacher"  # the README's "<pretrained, / as __>"
    folders = {"prune": out / "prune" / "teacher" / "reap-r0.5", "train": out / "train" / "teacher" / "reap-r0.5",
               "eval": eval_dir, "lm_eval": lm_dir}
    for stage, (required, optional) in stage_table(readme).items():
        written = sorted(p.name + ("/" if p.is_dir() else "") for p in folders[stage].iterdir())
        unlisted = [name for name in written if not any(re.fullmatch(p, name) for p in required + optional)]
        missing = [pattern for pattern in required if not any(re.fullmatch(pattern, name) for name in written)]
        assert not unlisted and not missing, (stage, unlisted, missing, written)
    modes = {row["mode"] for row in json.loads((eval_dir / "results.json").read_text())["rows"]}
    assert modes == {"full", "conventional", "slimwise", "reverse", "conventional_distill", "slimwise_distill"}
    for mode in ("conventional", "slimwise", "reverse"):
        assert len(list(lm_dir.glob(f"slimwise_lengths_{mode}_reap-r0.5-*.jsonl"))) == 1  # -<digest of keep set>
        assert len(list(lm_dir.glob(f"slimwise_summary_{mode}_reap-r0.5-*.json"))) == 1
    assert (lm_dir / "slimwise_lengths_reap-r0.5.png").is_file()
    report = (lm_dir / "slimwise_report.md").read_text()
    table = [line for line in report.splitlines() if line.startswith("| ") and not line.startswith("| mode")]
    assert [line.split(" | ")[0][2:] for line in table] == ["full", "conventional", "slimwise", "reverse"]
    assert "| mode | slimwise_math | slimwise_code | slimwise_tool | all | worst family" in report  # suite order
    assert table[0].endswith("| 1.00x |") and table[2].endswith("x |") and not table[2].endswith("1.00x |")
    assert "Custom kwargs can be passed to `--metadata`" not in proc.stderr + proc.stdout


# What the tour's placeholders stand for in its run (model teacher, REAP 50%, the lm-eval loop's four modes).
PLACEHOLDERS = {"keep set": r"reap-r0\.5", "run": r"(full|(conventional|slimwise|reverse)_reap-r0\.5-[0-9a-f]{8})",
                "task": "slimwise_(math|code|tool)", "date_time": ".+"}


def stage_table(readme: str) -> dict[str, tuple[list[str], list[str]]]:
    """{stage: ([regex of each file or folder the README's stage table lists for it], [those it lists as optional])}:
    every backticked file name (an extension or a trailing / for a folder) in the table's last column, a name
    inside "(with <setting>: ...)" optional, `<placeholder>` read as what it stands for in the tour."""
    section = readme.split("## A five-minute tour", 1)[1]
    table_end = section.index("\n\n", section.index("| stage"))

    def pattern(name: str) -> str:
        parts = re.split(r"(<[^>]+>)", name)
        return "".join(PLACEHOLDERS.get(p[1:-1], ".+") if p.startswith("<") else re.escape(p) for p in parts)

    def files(text: str) -> list[str]:
        return [pattern(n) for n in re.findall(r"`([^`=]+(?:\.\w+|/))`", text)]

    table = {}
    for line in section[:table_end].splitlines():
        if not line.startswith("| ") or line.startswith(("| stage", "|---")):
            continue
        stage, _, listed = [cell.strip() for cell in line.strip("|").split(" | ")]
        optional = re.findall(r"\(with [^)]*\)", listed)
        table[stage] = (files(re.sub(r"\(with [^)]*\)", "", listed)), files(" ".join(optional)))
    return table


@pytest.mark.slow
def test_the_readmes_test_count_is_what_pytest_collects():
    """The Tests section's count stays within the slack it states of what pytest collects (in a child: this session
    may have collected only some files)."""
    said = re.search(r"about (\d+) tests \(a test keeps this count within (\d+)% of what pytest collects\)",
                     (REPO / "README.md").read_text())
    assert said, "the README's Tests section no longer states its count and slack this way"
    count, slack = int(said.group(1)), int(said.group(2))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    collected = int(re.search(r"(\d+) tests? collected", proc.stdout).group(1))
    assert abs(collected - count) <= count * slack / 100, f"README says about {count} tests, pytest collects {collected}"


def test_every_page_with_commands_says_they_run_in_the_venv():
    """A user pasting a command from any page must learn there that it runs in the activated venv."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    with_commands = [p for p in pages if re.search(r"python -m slimwise_train|torchrun|python scripts/", p.read_text())]
    assert len(with_commands) > 5
    silent = [p.name for p in with_commands if "source .venv/bin/activate" not in p.read_text()]
    assert not silent, silent
