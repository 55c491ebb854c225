"""Offline batch generation with the bundled SmolLM2 (or any HF dir / GGUF given as argv[1])."""

import sys

from pagedcore import LLM, SamplingParams

llm = LLM(sys.argv[1] if len(sys.argv) > 1 else None)
questions = ["What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers."]
outputs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                   SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, seed=0))
for q, out in zip(questions, outputs):
    print(f"### {q}\n{out.outputs[0].text}\n")
