"""The ranks' process groups and the collectives tensor parallelism needs, timed.

Two groups over one rendezvous store, built as process-group objects of their own (no torch.distributed
default group, so several engines may live in one process, one after the other or at once):

- `tp`: the model's collectives (all-reduce after row-parallel linears, the vocabulary-parallel
  embedding's all-reduce, the LM head's gather on rank 0). gloo on CPU, NCCL on CUDA; its timeout is
  `distributed_timeout`, so a rank that died or hangs fails the step in bounded time.
- `control`: gloo on the CPU, for rank 0's step messages (pickled) and start-up handshakes, with the same
  timeout: an idle rank 0 sends a heartbeat message well within it (executor.py), so idle workers wait
  there as long as the engine lives, and learn within the timeout that it is gone.

gloo's bf16 all-reduce is unreliable (pytorch#111131), and gloo moves no 16-bit floats at all: on CPU,
reductions run in fp32 and gathers move the raw bytes.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

STARTUP_TIMEOUT_S = 600.0  # ranks loading the model at their own pace


@dataclass
class CommStats:
    """Time this rank spent inside the model's collectives (waiting for the slowest rank included)."""

    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0
    by_op: dict = field(default_factory=dict)  # op -> [calls, seconds]

    def add(self, op: str, seconds: float, nbytes: int) -> None:
        self.seconds += seconds
        self.calls += 1
        self.bytes += nbytes
        entry = self.by_op.setdefault(op, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds


class Comm:
    """This rank's view of the tensor-parallel group."""

    def __init__(self, store, rank: int, world_size: int, device: torch.device, timeout: float,
                 gloo_host: str | None = None, check=None):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.store, self.check = store, check
        self.stats = CommStats()
        self._last_work = {}  # each group's last work (see _wait)
        self.barrier("connect")  # start-up may take long (a cold import): not bounded by the op timeout
        tp_timeout = datetime.timedelta(seconds=timeout)
        self.control = _gloo(dist.PrefixStore("control", store), rank, world_size, tp_timeout, gloo_host)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = tp_timeout
            self.tp = dist.ProcessGroupNCCL(dist.PrefixStore("tp", store), rank, world_size, opts)
        else:
            self.tp = _gloo(dist.PrefixStore("tp", store), rank, world_size, tp_timeout, gloo_host)
        # On CUDA a collective returns once launched: its time shows only if each one is waited for, which
        # costs the overlap; the throughput bench asks for it (PAGEDCORE_TP_SYNC_TIMING=1).
        self._cuda_timing = device.type == "cuda" and os.environ.get("PAGEDCORE_TP_SYNC_TIMING") == "1"

    def barrier(self, name: str, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Wait, polling the store, until every rank got here; `check()` (rank 0: are the workers
        alive?) may raise meanwhile. For start-up phases whose length is not a collective's."""
        self.store.set(f"{name}/{self.rank}", b"1")
        keys = [f"{name}/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + timeout
        while not self.store.check(keys):
            if self.check is not None:
                self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks not all at {name!r} after {timeout:.0f} s")
            time.sleep(0.02)

    # ---- the model's collectives ----------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (out of place when the dtype goes through fp32)."""
        t0 = time.perf_counter()
        buf = x.float() if x.device.type == "cpu" and x.dtype != torch.float32 else x.contiguous()
        self._wait(self.tp, self.tp.allreduce([buf]))
        out = buf.to(x.dtype) if buf.dtype != x.dtype else buf
        self._time("all_reduce", t0, buf)
        return out

    def all_gather_last(self, x: torch.Tensor, size: int) -> torch.Tensor:
        """Every rank's `x` (each padded to the same width) concatenated on the last dim, cut to `size`."""
        t0 = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._wait(self.tp, self.tp.allgather([[_raw(p) for p in parts]], [_raw(x.contiguous())]))
        out = torch.cat(parts, -1)[..., :size]
        self._time("all_gather", t0, x)
        return out

    def gather_last(self, x: torch.Tensor, size: int) -> torch.Tensor | None:
        """Rank 0: every rank's `x` concatenated on the last dim, cut to `size`; other ranks: None."""
        t0 = time.perf_counter()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        x = x.contiguous()
        if self.device.type == "cuda":  # NCCL gathers through its own path; the logits are small
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            self._wait(self.tp, self.tp.allgather([parts], [x]))
            out = torch.cat(parts, -1)[..., :size] if self.rank == 0 else None
        elif self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            self._wait(self.tp, self.tp.gather([[_raw(p) for p in parts]], [_raw(x)], opts))
            out = torch.cat(parts, -1)[..., :size]
        else:
            self._wait(self.tp, self.tp.gather([], [_raw(x)], opts))
            out = None
        self._time("gather", t0, x)
        return out

    def _wait(self, group, work) -> None:
        """Wait for `work` and hold it until the group's next one. gloo's worker thread drops its own reference
        just after the work completes; were that the last one, the work's tensors (Python objects) would be
        freed on that thread, which takes the GIL for it: during interpreter exit a thread taking the GIL
        is ended mid-destructor and the process aborts ("terminate called without an active exception",
        torchrun ranks leaving their script). Held here, the last work is freed by Python, on its thread."""
        work.wait()
        self._last_work[group is self.tp] = work

    def _time(self, op: str, t0: float, x: torch.Tensor) -> None:
        if self._cuda_timing:
            torch.cuda.synchronize(self.device)  # the collective's own time, not its launch
        self.stats.add(op, time.perf_counter() - t0, x.numel() * x.element_size())

    # ---- control: pickled objects from rank 0 ---------------------------------------------------
    def broadcast_object(self, obj=None):
        """Rank 0 sends `obj`, every rank returns it."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                       dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._wait(self.control, self.control.broadcast([size], _root(0)))
        if self.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._wait(self.control, self.control.broadcast([payload], _root(0)))
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def gather_objects(self, obj) -> list | None:
        """Rank 0: every rank's `obj`, by rank; other ranks: None."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._wait(self.control, self.control.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]))
        width = max(int(s.item()) for s in sizes)
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world_size)]
        self._wait(self.control, self.control.allgather([parts], [buf]))
        if self.rank != 0:
            return None
        return [pickle.loads(p[:int(s.item())].numpy().tobytes()) for p, s in zip(parts, sizes)]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (all ranks get it)."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._wait(self.control, self.control.allreduce([t], opts))
        return int(t.item())


def _gloo(store, rank: int, world_size: int, timeout: datetime.timedelta, host: str | None):
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    if host is not None:
        device = dist.ProcessGroupGloo.create_device(hostname=host)
    elif iface:
        device = dist.ProcessGroupGloo.create_device(interface=iface.split(",")[0])
    else:
        device = dist.ProcessGroupGloo.create_default_device()
    opts._devices = [device]
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def _root(rank: int):
    opts = dist.BroadcastOptions()
    opts.rootRank = rank
    return opts


def _raw(t: torch.Tensor) -> torch.Tensor:
    """gloo moves no 16-bit floats: send their bytes (exact)."""
    if t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.uint8)
    return t
