"""How a tensor-parallel rank comes to exist and finds its place: the Python interpreter the executor
spawns its workers with and the free loopback port they meet on, torchrun's env:// rendezvous for
`distributed_executor_backend="external_launcher"` (each engine's own store prefix), and the rank's
device and share of the host's CPU threads. This is process plumbing, the same for rank 0 and the
workers, kept apart from the executor (executor.py), which is about driving the steps once the ranks
are up.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pagedcore.config import EngineConfig

_instances = iter(range(1 << 62))  # the same on every rank of an SPMD script: one store prefix per engine


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    device = config.torch_device()
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def set_threads(config: EngineConfig, device: torch.device, local_world_size: int) -> None:
    """CPU ranks on one host share its cores: by default each takes its share of them."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    elif device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def _td(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_executable() -> str:
    """A Python interpreter for the workers: this one's, or (inside Triton's Python-backend stub, whose
    sys.executable is not Python) the one of this interpreter's prefix."""
    candidates = [sys.executable, getattr(sys, "_base_executable", ""),
                  os.path.join(sys.prefix, "bin", "python3"), os.path.join(sys.prefix, "bin", "python"),
                  shutil.which("python3") or ""]
    for c in candidates:
        if c and Path(c).name.startswith("python") and os.access(c, os.X_OK):
            return c
    raise RuntimeError(f"no Python interpreter found for the tensor-parallel workers (tried {candidates})")


def external_rendezvous(config: EngineConfig):
    """(store, rank, local rank, local world size) from torchrun's environment (env://)."""
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(f"distributed_executor_backend='external_launcher' needs torchrun's environment "
                         f"(missing {', '.join(missing)}): run the script with torchrun --nproc-per-node "
                         f"{config.tensor_parallel_size}")
    world = int(os.environ["WORLD_SIZE"])
    if world != config.tensor_parallel_size:
        raise ValueError(f"torchrun started {world} ranks but tensor_parallel_size is {config.tensor_parallel_size}")
    store, rank, _ = next(dist.rendezvous("env://", timeout=_td(config.distributed_timeout)))
    store = dist.PrefixStore(f"pagedcore-{next(_instances)}", store)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return store, rank, local_rank, local_world
