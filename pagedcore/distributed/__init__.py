"""Tensor parallelism on torch.distributed (README "Tensor parallelism").

- tp_plan.py: shard any Hugging Face decoder by its own tensor-parallel plan (no per-model code).
- comm.py: the ranks' process groups (gloo on CPU, NCCL on CUDA) and the timed collectives.
- executor.py: rank 0's side: spawn or join the workers, broadcast each step, fail cleanly.
- worker.py: the other ranks' thin loop.
"""
