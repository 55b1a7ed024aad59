"""Cluster launches: Hydra sweeps through hydra-submitit-launcher (conf/hydra/launcher/{slurm,local}.yaml), ranks
that take their torch.distributed environment from a submitit / SLURM task (utils/distributed.py).

What runs here (2 CPU cores, no SLURM): submitit's local executor, which is the same code path as SLURM from the
pickled Hydra job onwards (one submitit job per sweep job, its tasks = ranks, `python -m submitit.core._submit`
per task). A real `sbatch` cannot run here: the SLURM launcher is checked up to the sbatch script it submits (a
stand-in `sbatch` on PATH keeps the script and refuses the job), and the SLURM variables -> RANK/WORLD_SIZE/...
mapping is checked on the variables SLURM sets. Tiny settings of tests/test_train_dist.py (COMMON).

Tolerance: the submitit run and the torchrun run are the same computation (2 ranks, gloo, fp32, one thread per
rank, same seeds, split points and all-reduce order): asserted bitwise (torch.equal) on every trained tensor and
equal logged losses. Only how the ranks got RANK/WORLD_SIZE/MASTER_* differs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_train_dist import COMMON, REPO, _env, metrics, summary

# Variables that would make a launched process think it is already a rank, or inside a SLURM / submitit job.
_JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "SLIMWISE_DIST_SOURCE")


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in _env().items()
           if k not in _JOB_VARS and not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_"))}
    return {**env, **extra}


def _run(cmd, timeout=300, env=None) -> subprocess.CompletedProcess:
    """Run in its own session and kill the whole session on a timeout: submitit's local controller and its tasks
    outlive the Hydra process otherwise."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env or _clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s\n{out[-2000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def _trained(run_dir) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "student_trainable.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 2-job sweep (prune.ratio=0.25,0.5) through hydra/launcher=local, 2 tasks (ranks) per job, ZeRO-2; then
    torchrun with the same config at ratio 0.5. Both jobs of the sweep run at once (submitit's local executor)."""
    root = tmp_path_factory.mktemp("cluster")
    times = {}
    start = time.perf_counter()
    _ok(_run([sys.executable, "-m", "slimwise_train", "--multirun", "hydra/launcher=local", *COMMON, "engine=zero2",
              "prune.ratio=0.25,0.5", f"hydra.sweep.dir={root / 'sweep'}"]))
    times["submitit_local sweep (2 jobs x 2 ranks)"] = time.perf_counter() - start
    start = time.perf_counter()
    _ok(_run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
              "slimwise_train", *COMMON, "engine=zero2", "prune.ratio=0.5", f"hydra.run.dir={root / 'torchrun'}"]))
    times["torchrun (1 job x 2 ranks)"] = time.perf_counter() - start
    print({k: f"{v:.1f} s" for k, v in times.items()})
    return root


@pytest.mark.dist
@pytest.mark.subprocess
def test_submitit_local_zero2_two_ranks_equal_torchrun_bitwise(runs):
    sub, ref = runs / "sweep" / "reap-r0.5", runs / "torchrun"
    s = summary(sub)
    assert s["world_size"] == 2 and s["engine"] == "zero2" and s["steps"] == 12
    assert len(s["rank_trainable_digests"]) == 2 and len(set(s["rank_trainable_digests"])) == 1
    got, want = _trained(sub), _trained(ref)
    assert got.keys() == want.keys() and got
    unequal = [k for k in want if not torch.equal(got[k], want[k])]
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert unequal == [], f"{len(unequal)} tensors differ from torchrun's, max |diff| {worst:.3g}"
    assert s["trainable_digest"] == summary(ref)["trainable_digest"]
    losses = lambda run: [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(run) if "loss" in r]  # noqa: E731
    assert losses(sub) == losses(ref)


@pytest.mark.dist
@pytest.mark.subprocess
def test_sweep_through_the_local_submitit_launcher_writes_both_runs(runs):
    sweep = runs / "sweep"
    ports = set()
    for ratio, kept in (("0.25", [6, 6]), ("0.5", [4, 4])):
        run = sweep / f"reap-r{ratio}"
        s = summary(run)
        assert s["keep_set"] == kept and s["steps"] == 12 and s["world_size"] == 2
        assert json.loads((run / "keep_set.json").read_text())["meta"]["ratio"] == float(ratio)
        # Both tasks share this folder; only rank 0 writes: each step once, one export, the lock released.
        assert [r["step"] for r in metrics(run) if "loss" in r] == list(range(1, 13))
        assert (run / "export" / "config.json").is_file() and (run / "train_config.yaml").is_file()
        assert not (run / ".slimwise.lock").exists()
        log = (run / "train.log").read_text()
        found = re.findall(r"rank 0 of 2 from the submitit-local task environment, master 127\.0\.0\.1:(\d+)", log)
        assert len(found) == 1 and "rank 1 of 2" not in log, log[:2000]
        ports.add(found[0])
    assert len(ports) == 2  # each job its own master port (the jobs ran at the same time)
    # submitit's files stay under the sweep folder: one folder per job, a result per task, no task failed.
    jobs = [p for p in (sweep / ".submitit").iterdir() if p.is_dir() and p.name.isdigit()]
    assert len(jobs) == 2
    for job in jobs:
        assert sorted(p.name.split("_")[1] for p in job.glob("*_result.pkl")) == ["0", "1"]
        for err in job.glob("*_log.err"):
            text = err.read_text()
            assert "Traceback" not in text and "terminate called" not in text, text[-2000:]


_FAKE_SBATCH = """#!/bin/sh
# Stand-in for sbatch: keep the script submitit wrote, then refuse the job (no cluster here).
cp "$1" "$SBATCH_CAPTURE/$(basename "$1")"
echo "sbatch: error: stand-in sbatch, no cluster here" >&2
exit 1
"""


@pytest.mark.dist
@pytest.mark.parametrize("app,sweep", [
    ("slimwise_train", "prune.ratio=0.25,0.5,0.75"),
    ("slimwise_train.prune", "prune.ratio=0.25,0.5,0.75"),
    ("slimwise_train.eval", "eval.num_per_family=10,20,40"),
])
@pytest.mark.subprocess
def test_every_app_submits_an_8gpu_x_2node_sbatch_array(tmp_path, app, sweep):
    bin_dir, capture = tmp_path / "bin", tmp_path / "capture"
    bin_dir.mkdir()
    capture.mkdir()
    (bin_dir / "sbatch").write_text(_FAKE_SBATCH)
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit only checks that srun exists
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = _clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SBATCH_CAPTURE=str(capture))
    proc = _run([sys.executable, "-m", app, "--multirun", "hydra/launcher=slurm", "hydra.launcher.partition=gpu",
                 sweep, f"hydra.sweep.dir={tmp_path / 'sweep'}"], timeout=120, env=env)
    assert proc.returncode != 0 and "stand-in sbatch" in proc.stderr + proc.stdout, proc.stderr[-3000:]
    scripts = list(capture.iterdir())
    assert len(scripts) == 1  # one job array for the whole sweep (array_parallelism 8, capped at 3 jobs)
    text = scripts[0].read_text()
    name = {"slimwise_train": "train"}.get(app, app.split(".")[-1])
    for line in ("#SBATCH --array=0-2%3", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=12", "#SBATCH --mem=960GB",
                 "#SBATCH --partition=gpu", "#SBATCH --time=1440", f"#SBATCH --job-name={name}",
                 "export SLURM_KILL_BAD_EXIT=1", "export OMP_NUM_THREADS=12", "export SUBMITIT_EXECUTOR=slurm"):
        assert line in text.splitlines(), (line, text)
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert f"{sys.executable} -u -m submitit.core._submit" in srun
    # The three sweep jobs are pickled, each with its overrides, waiting for the array's tasks.
    assert len(list((tmp_path / "sweep" / ".submitit").glob("**/*.pkl"))) == 3


# ----------------------------------------------------------------------------- task environment -> RANK etc.


@pytest.fixture
def bare_env(monkeypatch):
    for key in list(os.environ):
        if key in _JOB_VARS or key.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_")):
            monkeypatch.delenv(key)
    return monkeypatch


def test_a_submitit_slurm_task_becomes_its_rank(bare_env):
    from slimwise_train.utils.distributed import _master_port, env_from_job_launcher

    # Task 9 of a 2-node x 8-task job (what submitit's sbatch script + srun give the second node's second task).
    for key, value in dict(SUBMITIT_EXECUTOR="slurm", SLURM_JOB_ID="4242", SLURM_NTASKS="16", SLURM_PROCID="9",
                           SLURM_LOCALID="1", SLURM_NODEID="1", SLURM_JOB_NUM_NODES="2",
                           SLURM_JOB_NODELIST="gpu-a[07-08]", SLURM_ARRAY_JOB_ID="4242",
                           SLURM_ARRAY_TASK_ID="2").items():
        bare_env.setenv(key, value)
    env = env_from_job_launcher()
    assert env == {"RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8",
                   "MASTER_ADDR": "gpu-a07", "MASTER_PORT": str(_master_port("4242_2")),
                   "SLIMWISE_DIST_SOURCE": "submitit-slurm"}
    assert 20000 <= int(env["MASTER_PORT"]) < 60000 and _master_port("4242_1") != _master_port("4242_2")
    assert "CUDA_VISIBLE_DEVICES" not in env  # every task keeps its node's GPUs and takes cuda:LOCAL_RANK
    bare_env.setenv("MASTER_PORT", "29555")  # a port the site allows wins
    assert env_from_job_launcher()["MASTER_PORT"] == "29555"
    bare_env.setenv("RANK", "3")  # torchrun (or anyone) set the variables: nothing is derived
    assert env_from_job_launcher() == {}


def test_a_bare_srun_task_becomes_its_rank_but_an_sbatch_shell_does_not(bare_env):
    from slimwise_train.utils.distributed import env_from_job_launcher

    # The batch script's own shell: SLURM_NTASKS counts the allocation, but this is one process.
    for key, value in dict(SLURM_JOB_ID="77", SLURM_NTASKS="16", SLURM_PROCID="0", SLURM_LOCALID="0",
                           SLURM_JOB_NODELIST="n[1-2]").items():
        bare_env.setenv(key, value)
    assert env_from_job_launcher() == {}
    # `srun python -m slimwise_train ...`: a step of 16 tasks on n1, n2.
    for key, value in dict(SLURM_STEP_NUM_TASKS="16", SLURM_STEP_ID="0", SLURM_STEP_NODELIST="n[1-2]",
                           SLURM_PROCID="15", SLURM_LOCALID="7").items():
        bare_env.setenv(key, value)
    env = env_from_job_launcher()
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "15", "LOCAL_RANK": "7", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "n1"}
    assert env["SLIMWISE_DIST_SOURCE"] == "slurm"
    bare_env.setenv("SLURM_STEP_NUM_TASKS", "1")  # a one-task step: world size 1, nothing to set up
    assert env_from_job_launcher() == {}


@pytest.mark.subprocess
def test_submitit_tasks_do_not_die_with_their_parent_torchrun_ranks_do(tmp_path):
    # PR_SET_PDEATHSIG (rundir.die_with_launcher) is for torchrun workers only: a submitit task's parent is the
    # local controller or slurmstepd, which stop their tasks themselves.
    probe = ("import ctypes, os; from slimwise_train.utils.rundir import die_with_launcher; die_with_launcher(); "
             "sig = ctypes.c_int(-1); ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0); print(sig.value)")
    task = _clean_env(SUBMITIT_EXECUTOR="local", LOCAL_RANK="1", RANK="1", WORLD_SIZE="2",
                      SLIMWISE_DIST_SOURCE="submitit-local")
    assert _ok(_run([sys.executable, "-c", probe], env=task, timeout=60)).stdout.strip() == "0"
    worker = _clean_env(TORCHELASTIC_RUN_ID="x", LOCAL_RANK="1")
    assert _ok(_run([sys.executable, "-c", probe], env=worker, timeout=60)).stdout.strip() == str(int(signal.SIGKILL))
