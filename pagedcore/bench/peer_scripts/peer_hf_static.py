"""Peer: transformers generate() in static batches (left-padded, each batch runs to its longest request)."""

from _peer_common import load_spec, now, throughput_result, write


def main() -> None:
    spec, out = load_spec()
    import torch
    from transformers import AutoModelForCausalLM

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    dtype = getattr(torch, spec["dtype"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype, attn_implementation="sdpa").eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    batch_size = spec.get("options", {}).get("batch_size", 32)
    prompts, out_lens = spec["prompts"], spec["output_lens"]

    def run(batch, n):
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=pad)

    with torch.inference_mode():
        run(prompts[:2], 2)  # warm-up
        t0 = now()
        for i in range(0, len(prompts), batch_size):
            run(prompts[i:i + batch_size], max(out_lens[i:i + batch_size]))
        dt = now() - t0
    # Only the requested tokens count: a static batch also computes past each short request's end.
    write(out, throughput_result("hf-static", dt, prompts, sum(out_lens), batch_size=batch_size))


if __name__ == "__main__":
    main()
