"""Write the bundled model as GPTQ, AWQ and compressed-tensors 4-bit checkpoints (round-to-nearest, group
64: the formats' common 128 does not divide the model's width of 576), with the same writers the format tests use, for `bench memory --weights`:

    .venv/bin/python benchmarks/quantized_checkpoints.py /tmp/pagedcore-quantized
    .venv/bin/pagedcore bench memory --weights bundled --weights bundled@int4 --weights bundled@int4:64 \\
        --weights bundled@gguf \\
        --weights /tmp/pagedcore-quantized/gptq --weights /tmp/pagedcore-quantized/awq \\
        --weights /tmp/pagedcore-quantized/compressed-tensors --json benchmarks/results/weights.json

Nothing is calibrated (no dataset here): the checkpoints measure bytes and speed, not quality.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

GROUP = 64


def bundled_model(dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedcore.model_loader import resolve_model_dir

    d = resolve_model_dir(None)
    return AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype), AutoTokenizer.from_pretrained(str(d))


def main(out: Path) -> None:
    import test_awq
    import test_compressed_tensors
    import test_gptq

    writers = {"gptq": lambda p, t, m: test_gptq.make_checkpoint(p, t, group_size=GROUP, model=m),
               "awq": lambda p, t, m: test_awq.make_checkpoint(p, t, group_size=GROUP, model=m),
               "compressed-tensors": lambda p, t, m: test_compressed_tensors.make_checkpoint(
                   p, t, group_size=GROUP, model=m)}
    # compressed-tensors keeps its scales in the model's dtype: bf16, as llmcompressor writes a bf16 model
    # (GPTQ and AWQ store fp16 scales whatever the model's dtype).
    dtypes = {"compressed-tensors": torch.bfloat16}
    for name, write in writers.items():
        model, tokenizer = bundled_model(dtypes.get(name, torch.float32))
        path = out / name
        path.mkdir(parents=True, exist_ok=True)
        write(path, tokenizer, model)
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/pagedcore-quantized"))
