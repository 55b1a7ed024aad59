"""torch.distributed plumbing shared by the apps. Works without torchrun (world size 1)."""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist


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


def init_if_launched(backend: str = "auto") -> None:
    """Create the process group once per process when launched by torchrun (WORLD_SIZE > 1).

    Hydra multirun runs every job in the same process; re-creating the group per job fails on gloo
    ("connectFullMesh failed"), so it is created once here and destroyed only by `shutdown` at exit.
    """
    if is_initialized() or int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        return
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend=backend)


def broadcast_object(obj, src: int = 0):
    """`obj` as rank `src` has it, on every rank (unchanged without a process group)."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def full_shape(tensor) -> torch.Size:
    """The full shape of a parameter, also when ZeRO-3 holds only this rank's partition (then `.shape` is (0,))."""
    return torch.Size(getattr(tensor, "ds_shape", tensor.shape))


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Tear the group down cleanly: collect garbage first, since gloo threads still holding tensors at
    interpreter exit abort the process ("terminate called without an active exception")."""
    if not is_initialized():
        return
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
