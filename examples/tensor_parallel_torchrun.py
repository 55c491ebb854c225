"""Tensor parallelism across processes you launch yourself (README "Tensor parallelism"):

    .venv/bin/python -m torch.distributed.run --nproc-per-node 3 examples/tensor_parallel_torchrun.py
    # several hosts: --nnodes 2 --node-rank R --master-addr HOST --master-port PORT on each

Every rank runs this same script; rank 0's LLM returns the outputs, the other ranks' return [].
Without torchrun, `LLM(tensor_parallel_size=3)` spawns its workers itself.
"""

import os

from pagedcore import LLM, SamplingParams

llm = LLM(tensor_parallel_size=int(os.environ.get("WORLD_SIZE", "3")), distributed_executor_backend="external_launcher",
          num_threads=1)
outs = llm.chat([[{"role": "user", "content": "What is the capital of France?"}],
                 [{"role": "user", "content": "Write a haiku about the sea."}]],
                SamplingParams(temperature=0, max_tokens=48))
for out in outs:  # empty on ranks other than 0
    print(out.outputs[0].text)
