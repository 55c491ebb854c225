"""The tensor-parallel executor: rank 0 (the engine's process) drives N - 1 workers, vLLM's
multiprocessing-executor shape.

Rank 0 runs the scheduler, the input batch and the sampler once. Each step it turns the scheduler's
output into the step's flattened batch (the persistent InputBatch lives on rank 0 only), broadcasts that
`StepMessage` (swaps, copies and the batch's tensors, pickled) to the workers on the control group, and
runs its own shard's forward; every rank all-reduces inside its row-parallel linears; the logits are
gathered on rank 0, which samples. A worker is a thin loop: receive a message, `ModelRunner.execute` it on
its shard (worker.py).

Start-up: the engine spawns its workers (`python -m pagedcore.distributed.worker`, one process per rank,
a free loopback port for the rendezvous), or, with `distributed_executor_backend="external_launcher"`,
every rank is a process torchrun started (env:// rendezvous; ranks may live on several hosts) and only
rank 0's LLM returns outputs. Each rank loads the model, shards it by its plan (tp_plan.py), and the
ranks agree on one number of KV blocks (each holds its KV heads of every block).

Failure: a worker that exits fails the step in flight at once (gloo sees the closed connection; a
monitor thread also notices an idle death), one that hangs fails it after `distributed_timeout`; either
way the step's requests fail with `WorkerFailedError` naming the rank, the executor is dead (the ranks
are out of step for good), the engine reports itself unhealthy and the remaining workers are killed.
Shutdown stops the workers (a STOP message, then SIGKILL after a grace period); a worker whose parent
dies sees its stdin close and exits: no orphans.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pagedcore.config import EngineConfig
from pagedcore.distributed import tp_plan
from pagedcore.distributed.comm import Comm
from pagedcore.distributed.launch import _td, external_rendezvous, free_port, python_executable, set_threads
from pagedcore.input_batch import StepInputs
from pagedcore.model_runner import ModelRunner, ModelShape, available_memory

logger = logging.getLogger("pagedcore")

STOP, END_CALL, STATS, NOOP = "stop", "end_call", "stats", "noop"
STOP_GRACE_S = 10.0


class WorkerFailedError(RuntimeError):
    """A tensor-parallel rank died, hung, or fell out of step: the engine cannot go on."""


@dataclass
class StepMessage:
    """One step as rank 0 sends it: duck-types the SchedulerOutput fields ModelRunner.execute reads."""

    blocks_to_swap_out: list
    blocks_to_swap_in: list
    blocks_to_copy: list
    inputs: StepInputs


class PreparedBatch:
    """Stands in for a runner's InputBatch when its steps arrive prepared (a StepMessage)."""

    def apply(self, step: StepMessage) -> StepInputs:
        return step.inputs

    def free(self, seq_id: int) -> None:
        pass


PREPARED = PreparedBatch()


class WorkerRunner(ModelRunner):
    """A worker's runner: its steps come whole from rank 0."""

    def reset_input_batch(self) -> None:
        self.input_batch = PREPARED


class DriverRunner(ModelRunner):
    """Rank 0's runner: diffs the scheduler's output into the step's batch (its own InputBatch),
    hands it to the workers, then runs its own shard of the same step."""

    def __init__(self, executor: "TPExecutor", *args, **kwargs):
        self.executor = executor
        super().__init__(*args, **kwargs)

    def reset_input_batch(self) -> None:
        super().reset_input_batch()
        self.batch, self.input_batch = self.input_batch, PREPARED

    def execute(self, sched, argmax_only: bool = False, num_steps: int = 1, stop_early=None):
        # (no decode stack under TP: no greedy head, and one forward a step)
        msg = StepMessage(sched.blocks_to_swap_out, sched.blocks_to_swap_in, sched.blocks_to_copy,
                          self.batch.apply(sched))
        return self.executor.run_step(msg, super().execute)


# ---- every rank: shard, runner --------------------------------------------------------------------------
def shard(model, comm: Comm, config: EngineConfig) -> dict:
    summary = tp_plan.shard_model(model, comm, vocab_parallel=config.tensor_parallel_vocab)
    logger.info("tensor parallel rank %d/%d: %d modules sharded, %d heads and %d KV heads here",
                comm.rank, comm.world_size, summary["modules"], summary["heads"], summary["kv_heads"])
    return summary


def build_runner(cls, config: EngineConfig, model, backend, device: torch.device, dtype: torch.dtype, comm: Comm,
                 local_world_size: int, **kwargs) -> ModelRunner:
    """The rank's runner, with a KV cache of its KV heads and the block counts all ranks agreed on."""
    shape = ModelShape.from_hf_config(model.config)
    shape.num_kv_heads = model._pagedcore_tp_kv_heads
    elem = torch.empty((), dtype=dtype).element_size()
    per_block = 2 * shape.num_layers * config.block_size * shape.num_kv_heads * shape.head_dim * elem
    n = comm.world_size
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
    elif config.kv_cache_memory is not None:  # the whole engine's budget: each rank holds 1/n of each block
        blocks = config.kv_cache_memory // n // per_block
    else:  # of this rank's device; CPU ranks of one host share its memory
        share = local_world_size if device.type == "cpu" else 1
        blocks = int(available_memory(device) * config.kv_cache_fraction / share) // per_block
    cpu_blocks = config.num_cpu_blocks if config.num_cpu_blocks is not None else config.swap_space // n // per_block
    comm.barrier("loaded")  # every rank loaded and sharded its model, however long that took
    blocks, cpu_blocks = comm.min_int(blocks), comm.min_int(cpu_blocks)
    rank_config = dataclasses.replace(config, num_kv_blocks=blocks, num_cpu_blocks=cpu_blocks, compile=False,
                                      speculative_config=None)
    runner = cls(*([kwargs["executor"]] if "executor" in kwargs else []), rank_config, model, backend, device, dtype)
    info = {"rank": comm.rank, "pid": os.getpid(), "host": socket.gethostname(), "device": str(device),
            "num_kv_heads": shape.num_kv_heads, "kv_cache_shape": tuple(runner.kv_caches[0][0].shape),
            "num_blocks": runner.num_blocks, "threads": torch.get_num_threads()}
    runner.rank_info = comm.gather_objects(info)
    return runner


# ---- rank 0 --------------------------------------------------------------------------------------------
class TPExecutor:
    def __init__(self, config: EngineConfig, model, device: torch.device):
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.external = config.distributed_executor_backend == "external_launcher"
        self.lock = threading.RLock()
        self.failure: str | None = None
        self.closed = False
        self.procs: list[subprocess.Popen] = []
        self.error_files: list[Path] = []
        self.num_steps = 0
        self.model = model
        tp_plan.check_plan(model, self.world_size)  # before any process starts: a clear error, at once
        try:
            if self.external:
                store, rank, local_rank, local_world = external_rendezvous(config)
                if rank != 0:
                    raise ValueError("rank 0 only: worker ranks run pagedcore.distributed.worker.ExternalWorker")
            else:
                if device.type == "cpu":  # build the C++ ops once, before N processes want them
                    from pagedcore.kernels import cpu_ext

                    cpu_ext.load()
                store, local_world = self._spawn_workers(), self.world_size
            self.local_world_size = local_world
            set_threads(config, device, local_world)
            self.device = device
            self.comm = Comm(store, 0, self.world_size, device, config.distributed_timeout,
                             gloo_host=None if self.external else "127.0.0.1", check=self._check_started)
            shard(model, self.comm, config)
        except BaseException as e:
            error = e if isinstance(e, tp_plan.TensorParallelError) else self._start_error(e)
            self._kill_workers()
            if error is e:
                raise
            raise error from e

    def make_runner(self, backend, dtype: torch.dtype) -> DriverRunner:
        """Rank 0's runner (after the engine's own installs, e.g. int4); waits for every worker's."""
        try:
            runner = build_runner(DriverRunner, self.config, self.model, backend, self.device, dtype, self.comm,
                                  self.local_world_size, executor=self)
        except BaseException as e:
            error = self._start_error(e)
            self._kill_workers()
            raise error from e
        self.rank_info = runner.rank_info
        self.last_message = time.monotonic()
        if self.procs:  # from now on the control group carries steps, heartbeats and stops only
            threading.Thread(target=self._monitor, name="pagedcore-tp-monitor", daemon=True).start()
        logger.info("tensor parallel: %d ranks ready: %s", self.world_size,
                    ", ".join(f"rank {i['rank']} pid {i['pid']} {i['device']} KV {i['kv_cache_shape']}"
                              for i in self.rank_info))
        return runner

    # ---- the step ------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.failure is None and not self.closed

    def run_step(self, msg: StepMessage, local):
        with self.lock:
            self._check()
            try:
                self._send(msg)
                self.num_steps += 1
                return local(msg)
            except BaseException as e:
                # The workers are somewhere inside this step's collectives: no way back into step
                # (KeyboardInterrupt included: it goes on up as it is, the executor dead behind it).
                error = self._fail(e)
                if isinstance(e, Exception):
                    raise error from e
                raise

    def end_call(self) -> None:
        """external_launcher: the worker ranks' matching LLM.generate call returns."""
        if self.external and self.healthy:
            with self.lock:
                try:
                    self._send(END_CALL)
                except Exception as e:
                    raise self._fail(e) from e

    def comm_stats(self) -> list[dict]:
        """Every rank's time in the model's collectives so far (rank 0 first)."""
        with self.lock:
            self._check()
            try:
                self._send(STATS)
                return self.comm.gather_objects(worker_stats(self.comm, self.num_steps))
            except Exception as e:
                raise self._fail(e) from e

    def _send(self, msg) -> None:
        self.comm.broadcast_object(msg)
        self.last_message = time.monotonic()

    def _check(self) -> None:
        if self.closed:
            raise WorkerFailedError("the tensor-parallel executor is shut down")
        if self.failure is not None:
            raise WorkerFailedError(f"{self.failure}; the engine is unhealthy: restart it")

    def _fail(self, e: BaseException) -> WorkerFailedError:
        if self.failure is None:
            self.failure = self._diagnose(e)
            logger.error("tensor parallel: %s", self.failure)
            self._kill_workers()
        return WorkerFailedError(f"{self.failure}; the engine is unhealthy: restart it")

    def _diagnose(self, e: BaseException) -> str:
        deadline = time.monotonic() + 2.0  # a worker killed mid-step: give its exit a moment to show
        while True:
            dead = self._dead_workers()
            if dead or not self.procs or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if dead:
            return "; ".join(dead)
        text = str(e)
        if "Timed out" in text or "timeout" in text.lower():
            return (f"no answer from the other tensor-parallel ranks within distributed_timeout "
                    f"({self.config.distributed_timeout:g} s): a worker hung or died ({type(e).__name__})")
        if "Connection closed" in text or "Connection reset" in text:
            return f"lost the connection to a tensor-parallel worker ({text.splitlines()[0][:200]})"
        return (f"rank 0 failed inside a tensor-parallel step ({type(e).__name__}: {text[:300]}); the ranks are "
                "out of step")

    # ---- spawned workers -------------------------------------------------------------------------
    def _spawn_workers(self):
        port = free_port()
        python = python_executable()
        env = dict(os.environ)
        root = Path(__file__).resolve().parents[2]  # the directory holding this pagedcore package
        if root.name not in ("site-packages", "dist-packages"):  # a checkout: the workers import the same one
            env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
        level = logging.getLogger("pagedcore").getEffectiveLevel()
        for rank in range(1, self.world_size):
            err = Path(tempfile.mkstemp(prefix=f"pagedcore-tp{rank}-", suffix=".err")[1])
            self.error_files.append(err)
            proc = subprocess.Popen([python, "-m", "pagedcore.distributed.worker"], stdin=subprocess.PIPE,
                                    env=env, start_new_session=False)
            self.procs.append(proc)
            args = {"config": self.config, "rank": rank, "world_size": self.world_size, "port": port,
                    "error_file": str(err), "log_level": level}
            data = pickle.dumps(args)
            proc.stdin.write(struct.pack("<Q", len(data)) + data)
            proc.stdin.flush()  # stdin stays open: the worker exits when it closes (this process is gone)
        timeout = self.config.distributed_timeout
        return dist.TCPStore("127.0.0.1", port, self.world_size, True, timeout=_td(timeout), wait_for_workers=False)

    def _check_started(self) -> None:
        dead = self._dead_workers()
        if dead:
            raise WorkerFailedError("; ".join(dead))

    def _dead_workers(self) -> list[str]:
        out = []
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                err = self._error_text(rank)
                out.append(f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited ({how})"
                           + (f": {err}" if err else ""))
        return out

    def _error_text(self, rank: int) -> str:
        try:
            text = self.error_files[rank - 1].read_text().strip()
        except (OSError, IndexError):
            return ""
        return text.splitlines()[-1][:300] if text else ""

    def _monitor(self) -> None:
        """An idle engine learns of a dead worker too (readiness false before the next request), and
        sends the idle workers a heartbeat well within distributed_timeout (their wait's limit)."""
        heartbeat = min(10.0, self.config.distributed_timeout / 4)
        while not self.closed and self.failure is None:
            dead = self._dead_workers()
            if dead and not self.closed and self.failure is None:
                self.failure = "; ".join(dead)
                logger.error("tensor parallel: %s", self.failure)
                self._kill_workers()  # the others would wait forever on a dead group
                return
            if time.monotonic() - self.last_message > heartbeat and self.lock.acquire(blocking=False):
                try:
                    if self.healthy and time.monotonic() - self.last_message > heartbeat:
                        self._send(NOOP)
                except Exception as e:
                    self._fail(e)
                finally:
                    self.lock.release()
            time.sleep(0.25)

    def _kill_workers(self, grace: float = 0.0) -> None:
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdin is not None and not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except OSError:
                    pass

    def _start_error(self, e: BaseException) -> BaseException:
        if not isinstance(e, Exception):
            return e
        dead = self._dead_workers()  # before the kill: which worker died first, and why
        why = "; ".join(dead) if dead else f"{type(e).__name__}: {e}"
        return WorkerFailedError(f"tensor-parallel start-up failed ({self.world_size} ranks): {why}")

    def shutdown(self) -> None:
        """Stop the workers and release the groups. Idempotent; waits for a step in flight."""
        if self.closed:
            return
        got = self.lock.acquire(timeout=self.config.distributed_timeout + 5)
        try:
            if self.closed:
                return
            self.closed = True
            if self.failure is None and not self.external and self.procs and hasattr(self, "comm"):
                try:
                    self._send(STOP)
                except Exception:  # a dead group: the kill below does it
                    pass
            self._kill_workers(grace=STOP_GRACE_S)
            for f in self.error_files:
                f.unlink(missing_ok=True)
            self.comm = None  # drops the process groups (their sockets close)
        finally:
            if got:
                self.lock.release()


def worker_stats(comm: Comm, num_steps: int) -> dict:
    s = comm.stats
    return {"rank": comm.rank, "comm_seconds": s.seconds, "comm_calls": s.calls, "comm_bytes": s.bytes,
            "by_op": {k: {"calls": v[0], "seconds": v[1]} for k, v in s.by_op.items()}, "steps": num_steps}
