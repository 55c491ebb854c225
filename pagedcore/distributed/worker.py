"""A tensor-parallel worker rank: load the model, shard it, build its runner, then a thin loop: receive
rank 0's step message, run `ModelRunner.execute` on this shard (its all-reduces meet rank 0's), repeat.

Spawned by the executor as `python -m pagedcore.distributed.worker` (its settings arrive pickled on
stdin, which stays open: when it closes, rank 0's process is gone and the worker exits), or made in
a torchrun rank by `LLM(..., distributed_executor_backend="external_launcher")` (ExternalWorker).
"""

from __future__ import annotations

import logging
import os
import struct
import sys
import threading
import traceback

logger = logging.getLogger("pagedcore")


class Worker:
    def __init__(self, config, store, rank: int, local_rank: int, local_world_size: int, gloo_host: str | None):
        import torch

        from pagedcore.distributed import executor as ex
        from pagedcore.distributed import launch
        from pagedcore.distributed.comm import Comm
        from pagedcore.plugins import make_plugin_manager

        self.device = launch.rank_device(config, local_rank)
        launch.set_threads(config, self.device, local_world_size)
        self.comm = Comm(store, rank, config.tensor_parallel_size, self.device, config.distributed_timeout, gloo_host)
        self.num_steps = 0
        self.stopped = False
        # Entry-point plugins apply here as on rank 0; plugin objects passed in code stay on rank 0.
        pm = make_plugin_manager(())
        self.model, self.tokenizer = pm.hook.pagedcore_load_model(config=config)
        ex.shard(self.model, self.comm, config)
        if config.quantization == "int4":
            from pagedcore.quantization import quantize_int4

            quantize_int4(self.model, self.device)
        backend = pm.hook.pagedcore_attention_backend(name=config.attention_backend, device=self.device)
        self.runner = ex.build_runner(ex.WorkerRunner, config, self.model, backend, self.device, self.model.dtype,
                                      self.comm, local_world_size)
        del torch

    def serve(self) -> None:
        """Run rank 0's steps until it ends the call (external_launcher) or stops the executor."""
        from pagedcore.distributed import executor as ex

        while True:
            msg = self.comm.broadcast_object()
            if isinstance(msg, ex.StepMessage):
                self.runner.execute(msg)
                self.num_steps += 1
            elif msg == ex.STATS:
                self.comm.gather_objects(ex.worker_stats(self.comm, self.num_steps))
            elif msg == ex.END_CALL:
                return
            elif msg == ex.STOP:
                self.stopped = True
                return
            # NOOP: rank 0's heartbeat while idle


class ExternalWorker(Worker):
    """A torchrun rank other than 0: `LLM.generate` serves rank 0's steps and returns []."""

    def __init__(self, config):
        from pagedcore.distributed.launch import external_rendezvous

        store, rank, local_rank, local_world = external_rendezvous(config)
        super().__init__(config, store, rank, local_rank, local_world, gloo_host=None)


def _read_exactly(fd: int, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError("the engine process closed the worker's stdin before sending its settings")
        out += chunk
    return out


def _watch_parent(fd: int) -> None:
    """stdin closes when rank 0's process exits, however it exits: then this worker must too."""
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    os._exit(0)


def main() -> int:
    import pickle

    (size,) = struct.unpack("<Q", _read_exactly(0, 8))
    args = pickle.loads(_read_exactly(0, size))
    threading.Thread(target=_watch_parent, args=(0,), name="pagedcore-tp-parent", daemon=True).start()
    logging.basicConfig(level=args["log_level"], format=f"%(asctime)s tp-rank{args['rank']} %(levelname)s %(message)s")
    try:
        import torch.distributed as dist

        from pagedcore.distributed.launch import _td

        config = args["config"]
        store = dist.TCPStore("127.0.0.1", args["port"], config.tensor_parallel_size, False,
                              timeout=_td(config.distributed_timeout))
        worker = Worker(config, store, args["rank"], args["rank"], config.tensor_parallel_size, gloo_host="127.0.0.1")
        worker.serve()
    except BaseException as e:
        with open(args["error_file"], "w") as f:
            f.write("".join(traceback.format_exception(e)))
            f.write(f"{type(e).__name__}: {e}\n")
        logger.error("tensor-parallel worker rank %d failed: %s: %s", args["rank"], type(e).__name__, e)
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown while gloo threads may still hold sockets


if __name__ == "__main__":
    sys.exit(main())
