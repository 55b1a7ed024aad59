"""torch.distributed plumbing shared by the apps. Works without torchrun (world size 1).

Ranks get their environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) from torchrun, or, when a
task is started by submitit (hydra/launcher=slurm|local, SLURM or local processes) or by a bare `srun`, from that
task's environment (`env_from_job_launcher`). docs/cluster.md has the commands and the pitfalls.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import os
import sys
from typing import Iterator

import torch
import torch.distributed as dist

log = logging.getLogger("slimwise")

# Set (to submitit-local, submitit-slurm or slurm) when this process's RANK/WORLD_SIZE/... were derived from a job
# launcher's task environment rather than given by torchrun (shows where a rank's environment came from).
SOURCE_VAR = "SLIMWISE_DIST_SOURCE"


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_rank0() -> bool:
    return rank() == 0


def cuda_index() -> int:
    """This rank's CUDA device: LOCAL_RANK, or LOCAL_RANK modulo the visible devices when the scheduler shows each
    task fewer GPUs than tasks per node (SLURM `--gpus-per-task=1` / gpu binding: every task sees one, as cuda:0)."""
    index, count = local_rank(), torch.cuda.device_count()
    if count and index >= count:
        if count > 1:
            log.warning("local rank %d sees only %d GPUs: using cuda:%d (more tasks per node than GPUs?)",
                        index, count, index % count)
        index %= count
    return index


def _master_port(job_id: str) -> int:
    # The same on every task of a job (no communication needed), different between jobs of a sweep that share a
    # node; MASTER_PORT, when set, wins (a site may allow only some ports).
    if os.environ.get("MASTER_PORT"):
        return int(os.environ["MASTER_PORT"])
    return 20000 + int(hashlib.sha256(job_id.encode()).hexdigest(), 16) % 40000


def env_from_job_launcher() -> dict[str, str]:
    """torch.distributed's env:// variables for a task started by submitit or a bare `srun`, {} otherwise.

    Nothing is derived where RANK or WORLD_SIZE already exist (torchrun, the DeepSpeed launcher, `srun torchrun`,
    a user's own): those win. Under submitit (SUBMITIT_EXECUTOR set: its local controller or its SLURM batch
    script) the values come from submitit.JobEnvironment(); under a bare srun step from SLURM_PROCID,
    SLURM_LOCALID, SLURM_STEP_NUM_TASKS and the first host of SLURM_STEP_NODELIST. SLURM_STEP_NUM_TASKS (set by
    srun) rather than SLURM_NTASKS: in an sbatch script's own shell SLURM_NTASKS counts the whole allocation, and
    a plain `python -m ...` there is one process, not rank 0 of many.

    submitit.helpers.TorchDistributedEnvironment().export() is not used: it raises where any of the variables
    exists, and by default sets CUDA_VISIBLE_DEVICES to the local rank, which puts every task on cuda:0.
    """
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return {}
    executor = os.environ.get("SUBMITIT_EXECUTOR", "")
    if executor:
        import submitit

        job = submitit.JobEnvironment()
        rank_, world, local = job.global_rank, job.num_tasks, job.local_rank
        nodes, master, job_id, source = job.num_nodes, job.hostnames[0], job.job_id, f"submitit-{executor}"
        if executor == "local":
            master = "127.0.0.1"
    elif "SLURM_PROCID" in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ:
        from submitit.slurm.slurm import _parse_node_list

        rank_, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_STEP_NUM_TASKS"])
        local = int(os.environ.get("SLURM_LOCALID", 0))
        node_list = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
        hosts = _parse_node_list(node_list) if node_list else ["127.0.0.1"]
        nodes, master, source = len(hosts), hosts[0], "slurm"
        job_id = f"{os.environ.get('SLURM_JOB_ID', '')}.{os.environ.get('SLURM_STEP_ID', '')}"
    else:
        return {}
    if world <= 1:
        return {}
    return {"RANK": str(rank_), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(max(1, world // max(1, nodes))), "MASTER_ADDR": master,
            "MASTER_PORT": str(_master_port(job_id)), SOURCE_VAR: source}


def init_if_launched(backend: str = "auto") -> None:
    """Create the process group once per process when launched with several ranks: by torchrun (WORLD_SIZE > 1),
    or as one of several tasks of a submitit / srun job (the variables are derived first, see
    `env_from_job_launcher`).

    Hydra multirun runs every job in the same process; re-creating the group per job fails on gloo
    ("connectFullMesh failed"), so it is created once here and destroyed only by `shutdown` at exit (a submitit
    task runs one job per process: `job_process_group` destroys it at the end of that job).
    """
    if is_initialized():
        return
    derived = env_from_job_launcher()
    if derived:
        os.environ.update(derived)
        # Rank 0 only at INFO: the tasks of a job share the run folder's log file (others quiet it once set up).
        (log.info if derived["RANK"] == "0" else log.debug)(
            "rank %s of %s from the %s task environment, master %s:%s", derived["RANK"], derived["WORLD_SIZE"],
            derived[SOURCE_VAR], derived["MASTER_ADDR"], derived["MASTER_PORT"])
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        return
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(cuda_index())
    dist.init_process_group(backend=backend)


def one_job_per_process() -> bool:
    """True in a task started by submitit (`python -m submitit.core._submit`): the process runs one Hydra job and
    exits, and no `__main__` of ours tears the group down afterwards."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", "") == "submitit.core._submit"


@contextlib.contextmanager
def job_process_group(backend: str = "auto") -> Iterator[None]:
    """One Hydra job's process group (what every app's main runs in): created if launched; torn down at the end
    of the job only in a submitit task (one job per process; gloo threads alive at interpreter exit abort it),
    otherwise by the app's `__main__` after the last multirun job. After a failure the group is destroyed without
    a barrier (a peer may be gone)."""
    init_if_launched(backend)
    ok = False
    try:
        yield
        ok = True
    finally:
        if one_job_per_process():
            shutdown(sync=ok)


def broadcast_object(obj, src: int = 0):
    """`obj` as rank `src` has it, on every rank (unchanged without a process group)."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def is_partitioned(tensor) -> bool:
    """A ZeRO-3 parameter (its data is this rank's partition; the full shape is `ds_shape`)."""
    return hasattr(tensor, "ds_id")


def full_shape(tensor) -> torch.Size:
    """The full shape of a parameter, also when ZeRO-3 holds only this rank's partition (then `.shape` is (0,))."""
    return torch.Size(getattr(tensor, "ds_shape", tensor.shape))


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def shutdown(sync: bool = True) -> None:
    """Tear the group down cleanly: collect garbage first, since gloo threads still holding tensors at
    interpreter exit abort the process ("terminate called without an active exception")."""
    if not is_initialized():
        return
    gc.collect()
    if sync:  # not after a failure: a peer may be gone
        dist.barrier()
    dist.destroy_process_group()
