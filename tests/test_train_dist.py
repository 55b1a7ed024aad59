"""Multi-process runs of `python -m slimwise_train` / torchrun on CPU (gloo): engines, sweep, SIGKILL + resume.

All runs: tiny Qwen3-MoE (hidden 32, 8 experts top-2), 12 steps of 8 sequences, lr 2e-2, gradient clipping at
0.05 so clipping is active and must agree across engines. The student is the new-expert one (routers, norms, a new
shared expert: distill.student.shared_expert_mode=new, distill/trainable=always_on), with which the tolerances below
were measured; the default on this family (LoRA on the kept experts) runs under ZeRO-3 and DDP in tests/test_lora.py.
The first DeepSpeed launch on a fresh machine builds its shm op into .cache/torch_extensions (~30-90 s once, `make`
does it at set-up); later launches load it from there (distill/engine.py prepare_shm_op) and take a few seconds.

Tolerances between engines: same global batch and split points, same normalisation, fp32. Measured max
|trained tensor - DDP's|: ZeRO-2 1.1e-7, ZeRO-3 6.9e-6, one process with 2 accumulation micro-batches (same 8
sequences, other micro-batch cuts, so other padding and summation order) 1.3e-5; Adam's normalisation magnifies
tiny gradient differences on near-zero components. Asserted: 1e-5 relative on losses and grad norms, 1e-4
absolute on the trained tensors (scale ~0.16; turning clipping off changes them by 6e-2, so a DeepSpeed run that
ignored distill.optim.grad_clip would fail).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import FAST_LR, REPO, TINY_TRAIN, compose_config, train_steps

pytestmark = [pytest.mark.dist, pytest.mark.subprocess]
COMMON = [*TINY_TRAIN, *FAST_LR, *train_steps(12), "distill.optim.grad_clip=0.05",
          "distill.student.shared_expert_mode=new", "distill/trainable=always_on"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled",
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}


def launch(args, nproc=2, timeout=300, expect=0):
    head = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
            if nproc > 1 else [sys.executable])
    proc = subprocess.run([*head, "-m", "slimwise_train", *args], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=timeout)
    if expect is not None:
        assert proc.returncode == expect, f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def summary(run_dir) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def trained(run_dir) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "student_trainable.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One sweep under torchrun (engine=torch, i.e. DDP, ratios 0.25 and 0.5), then ZeRO-2 and ZeRO-3 at 0.5."""
    root = tmp_path_factory.mktemp("dist")
    out = {}
    launch(["--multirun", *COMMON, "prune.ratio=0.25,0.5", f"hydra.sweep.dir={root / 'sweep'}"])
    out["ddp"] = root / "sweep" / "reap-r0.5"
    out["ddp_r0.25"] = root / "sweep" / "reap-r0.25"
    for engine in ("zero2", "zero3"):
        launch([*COMMON, f"engine={engine}", "prune.ratio=0.5", f"hydra.run.dir={root / engine}"])
        out[engine] = root / engine
    # ZeRO-3 as for a model bigger than one GPU: partitioned loading (the default) and MoE recompute.
    launch([*COMMON, "engine=zero3", "distill.memory.recompute=moe", "prune.ratio=0.5",
            f"hydra.run.dir={root / 'zero3_rc'}"])
    out["zero3_rc"] = root / "zero3_rc"
    return out


def test_sweep_over_two_ratios_under_torchrun(runs):
    for run, kept in ((runs["ddp_r0.25"], [6, 6]), (runs["ddp"], [4, 4])):
        s = summary(run)
        assert s["keep_set"] == kept and s["steps"] == 12 and s["world_size"] == 2
        assert json.loads((run / "keep_set.json").read_text())["meta"]["ratio"] in (0.25, 0.5)
        # Only rank 0 writes: one record per logged step, one export, one config.
        assert [r["step"] for r in metrics(run) if "loss" in r] == list(range(1, 13))
        assert (run / "export" / "config.json").is_file() and (run / "train_config.yaml").is_file()


@pytest.mark.parametrize("engine", ["ddp", "zero2", "zero3"])
def test_two_ranks_loss_falls_ranks_agree_frozen_unchanged(runs, engine):
    s = summary(runs[engine])
    assert s["engine"] == {"ddp": "torch"}.get(engine, engine)
    evals = [r for r in metrics(runs[engine]) if "eval/loss" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 12
    assert evals[-1]["eval/loss"] < 0.97 * evals[0]["eval/loss"]  # measured ~0.769 -> ~0.72
    assert len(s["rank_trainable_digests"]) == 2 and len(set(s["rank_trainable_digests"])) == 1
    assert s["frozen_unchanged"] is True


def test_engines_agree_with_each_other_and_with_one_process(runs, tmp_path):
    from slimwise_train.distill.trainer import run_train

    # One process, two accumulation micro-batches of 4: the same global batch of 8 as 2 ranks x 1 x 4.
    cfg = compose_config("train", *COMMON, "prune.ratio=0.5", "distill.schedule.grad_accum=2", f"output_dir={tmp_path}",
                         "resume=never")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_train(cfg)
    finally:
        torch.set_num_threads(threads)
    runs = {**runs, "single": tmp_path}
    reference = {r["step"]: r for r in metrics(runs["ddp"]) if "loss" in r}
    ref_tensors = trained(runs["ddp"])
    for name in ("zero2", "zero3", "zero3_rc", "single"):
        steps = {r["step"]: r for r in metrics(runs[name]) if "loss" in r}
        assert sorted(steps) == sorted(reference)
        for step, ref in reference.items():
            for key in ("loss", "kl", "ce", "grad_norm"):
                assert steps[step][key] == pytest.approx(ref[key], rel=1e-5), (name, step, key)
            assert steps[step]["lr"] == pytest.approx(ref["lr"], rel=1e-12)
        tensors = trained(runs[name])
        assert tensors.keys() == ref_tensors.keys()
        worst = max((tensors[k] - ref_tensors[k]).abs().max().item() for k in ref_tensors)
        print(f"{name}: max |trained - DDP| = {worst:.3g}")
        assert worst <= 1e-4, (name, worst)
        relative = max(((tensors[k] - ref_tensors[k]).norm() / ref_tensors[k].norm().clamp(min=1e-12)).item()
                       for k in ref_tensors)
        print(f"{name}: max relative |trained - DDP| per tensor = {relative:.3g}")
        if name.startswith("zero3"):
            assert relative <= 1e-5, (name, relative)
            for step, ref in reference.items():
                assert round(steps[step]["loss"], 4) == round(ref["loss"], 4), (name, step)
    # Clipping was active (grad norms above 0.05), so the explicit DeepSpeed gradient_clipping is exercised.
    assert max(r["grad_norm"] for r in reference.values()) > 0.05


def test_zero3_partitioned_export_reloads(runs):
    from transformers import AutoModelForCausalLM

    for name in ("zero3", "zero3_rc"):
        export = runs[name] / "export"
        # a new shared expert: the registered architecture, its code in the folder (a stock export loads either way)
        model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True).eval()
        assert json.loads((export / "config.json").read_text())["model_type"] == "slimwise_qwen3_moe"
        with torch.no_grad():
            logits = model(torch.tensor([[3, 4, 5, 6]])).logits
        assert torch.isfinite(logits).all() and json.loads((export / "slimwise_export.json").read_text())["num_kept"]


def test_sigkill_and_resume_match_the_uninterrupted_run_bitwise(tmp_path):
    args = [*COMMON, "distill.schedule.max_steps=6", "distill.checkpoint.every=2", "distill.checkpoint.keep=5",
            "distill.eval.every=6"]
    launch([*args, f"hydra.run.dir={tmp_path / 'straight'}"], nproc=1)

    run = tmp_path / "killed"
    # 1) SIGKILL while the step-4 checkpoint is being written (files done, folder not yet published).
    proc = launch([*args, f"hydra.run.dir={run}", "+extra.kill_in_checkpoint_at_step=4"], nproc=1, expect=None)
    assert proc.returncode == -9
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == [".step_000004.tmp", "step_000002"]  # the half-written one is unpublished
    # 2) resume=auto continues from step 2 and is killed again mid-run, after step 5 (newest complete: step 4).
    proc = launch([*args, f"hydra.run.dir={run}", "+extra.kill_after_step=5"], nproc=1, expect=None)
    assert proc.returncode == -9 and "resumed from" in proc.stderr + proc.stdout
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    # 3) resume=auto from step 4 to the end.
    launch([*args, f"hydra.run.dir={run}"], nproc=1)

    straight, resumed = trained(tmp_path / "straight"), trained(run)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)  # bitwise
    assert summary(run)["trainable_digest"] == summary(tmp_path / "straight")["trainable_digest"]
    # The replayed steps saw the same data and split points: identical logged losses.
    reference = {r["step"]: r["loss"] for r in metrics(tmp_path / "straight") if "loss" in r}
    logged = [(r["step"], r["loss"]) for r in metrics(run) if "loss" in r]  # continued across the three launches
    assert [s for s, _ in logged] == [1, 2, 3, 4, 5, 6]  # each resume cut the file back to its checkpoint's step
    assert all(loss == reference[step] for step, loss in logged)


def test_a_corrupt_newest_checkpoint_resumes_from_the_previous_one_bitwise(tmp_path):
    args = [*COMMON, "distill.schedule.max_steps=6", "distill.checkpoint.every=2", "distill.checkpoint.keep=5",
            "distill.eval.every=6"]
    launch([*args, f"hydra.run.dir={tmp_path / 'straight'}"], nproc=1)
    run = tmp_path / "corrupt"
    proc = launch([*args, f"hydra.run.dir={run}", "+extra.kill_after_step=5"], nproc=1, expect=None)
    assert proc.returncode == -9
    newest = run / "checkpoints" / "step_000004" / "trainable.safetensors"
    newest.write_bytes(newest.read_bytes()[:-100])  # a truncated file
    proc = launch([*args, f"hydra.run.dir={run}"], nproc=1)
    out = proc.stderr + proc.stdout
    assert "skipping checkpoint step_000004" in out and "trainable.safetensors does not match its checksum" in out
    assert "resumed from" in out and "step_000002 at step 2" in out
    straight, resumed = trained(tmp_path / "straight"), trained(run)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)  # bitwise
    assert [r["step"] for r in metrics(run) if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_killing_the_torchrun_parent_leaves_no_rank_alive(tmp_path):
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "slimwise_train",
         *COMMON, "distill.schedule.max_steps=100000", "distill.checkpoint.every=100000", "distill.eval.every=100000",
         f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    ranks: list[int] = []
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "run" / "metrics.jsonl").exists():
        time.sleep(0.5)
    ranks = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                            text=True).stdout.split()]
    assert len(ranks) == 2, "the two ranks did not start"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 30
    alive = ranks
    while alive and time.time() < deadline:
        time.sleep(0.5)
        alive = [pid for pid in ranks if Path(f"/proc/{pid}").exists()
                 and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()]
    for pid in alive:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert alive == [], f"ranks {alive} outlived their launcher by 30 s"


def test_a_bad_input_under_torchrun_ends_with_one_clear_line(tmp_path):
    proc = launch([*COMMON, "+distill.loss.terms.nope=1", f"hydra.run.dir={tmp_path / 'run'}"], expect=None)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("slimwise_train: error:")]
    assert len(ours) == 1 and "unknown distill.loss.terms key 'nope'" in ours[0]
    # torchrun's closing "Root Cause" block carries the same line instead of a pointer to its docs.
    tail = "\n".join(proc.stderr.strip().splitlines()[-12:])
    assert "unknown distill.loss.terms key 'nope'" in tail


def test_deepspeeds_zero_to_fp32_reads_our_checkpoints(runs, tmp_path):
    ckpt = runs["zero2"] / "checkpoints" / "step_000012"
    assert (ckpt / "latest").read_text().strip() == "deepspeed"
    proc = subprocess.run([sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(ckpt), str(tmp_path / "fp32"),
                           "--safe_serialization"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recovered = {}
    for file in (tmp_path / "fp32").glob("*.safetensors"):
        recovered.update(load_file(str(file)))
    ours = load_file(str(ckpt / "trainable.safetensors"))
    # It recovers the trainable tensors (frozen weights are not in our checkpoints: they are the teacher's).
    assert set(recovered) == set(ours) or {k.removeprefix("module.") for k in recovered} == set(ours)
    for key, value in ours.items():
        got = recovered.get(key, recovered.get(f"module.{key}"))
        assert got is not None and torch.equal(got.float(), value), key


@pytest.mark.slow
def test_deepspeeds_shm_op_builds_once_whichever_ninja_comes_first_on_path(tmp_path):
    """Two DeepSpeed launches into a fresh extensions folder, the second with the PATH order reversed (the system's
    ninja first instead of the venv's, the two ninja versions reading each other's .ninja_log as invalid): the first
    builds the op and says so in one line, the second builds nothing (the library file and ninja's log untouched)."""
    ext = tmp_path / "torch_extensions"
    venv_bin = str(Path(sys.executable).parent)
    rest = [p for p in os.environ["PATH"].split(os.pathsep) if p != venv_bin]
    notice = "DeepSpeed: building its CPU shared-memory op once"

    def run(path: list[str], name: str) -> str:
        env = {**_env(), "TORCH_EXTENSIONS_DIR": str(ext), "PATH": os.pathsep.join(path)}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               "-m", "slimwise_train", *TINY_TRAIN, *train_steps(1), "engine=zero2",
                               f"hydra.run.dir={tmp_path / name}"], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout + proc.stderr

    first = run([venv_bin, *rest], "first")
    library = ext / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    built = library.stat()
    log = (ext / "deepspeed_shm_comm" / ".ninja_log").read_text()
    assert first.count(notice) == 1, first[-3000:]
    second = run([*rest, venv_bin], "second")
    assert notice not in second, second[-3000:]
    after = library.stat()
    assert (after.st_ino, after.st_mtime_ns) == (built.st_ino, built.st_mtime_ns), "the second launch rebuilt the op"
    assert (ext / "deepspeed_shm_comm" / ".ninja_log").read_text() == log
