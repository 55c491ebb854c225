"""An existing transformers script, plus one line: its model.generate() now runs through pagedcore.

    python examples/hf_generate.py [HF model dir]      (default: the bundled SmolLM2)
"""

import sys

from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

from pagedcore.adapters.hf import patch
from pagedcore.model_loader import resolve_model_dir

model_dir = str(resolve_model_dir(sys.argv[1] if len(sys.argv) > 1 else None))
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir)

patch(model)  # <- the one line (engine settings as for LLM(...) may follow, e.g. num_kv_blocks=512)

questions = ["What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers."]
texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
         for q in questions]
batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)

# A batch: each row is its own engine request and is done when its own answer is.
out = model.generate(**batch, max_new_tokens=64, do_sample=False)
for q, row in zip(questions, out[:, batch["input_ids"].shape[1]:]):
    print(f"### {q}\n{tokenizer.decode(row, skip_special_tokens=True)}\n")

# Beam search, with transformers' sequences_scores.
beams = model.generate(**batch, num_beams=4, num_return_sequences=2, max_new_tokens=32,
                       return_dict_in_generate=True, output_scores=True)
print("beam scores:", [round(s, 3) for s in beams.sequences_scores.tolist()])

# Streaming, stop strings: the same arguments as with transformers.
one = tokenizer(texts[1:2], return_tensors="pt", add_special_tokens=False)
model.generate(**one, max_new_tokens=64, streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
               stop_strings=["."], tokenizer=tokenizer)
