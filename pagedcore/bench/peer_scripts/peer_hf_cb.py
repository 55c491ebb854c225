"""Peer: transformers' own continuous batching (init_continuous_batching / add_request / get_result)."""

from _peer_common import load_spec, now, throughput_result, write


def main() -> None:
    spec, out = load_spec()
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    opts = spec.get("options", {})
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=getattr(torch, spec["dtype"]),
                                                 attn_implementation=opts.get("attn_implementation", "sdpa")).eval()
    prompts, out_lens = spec["prompts"], spec["output_lens"]
    # eos -1 disables EOS: exact output lengths, as every engine in the run is asked for.
    config = GenerationConfig(do_sample=False, max_new_tokens=max(out_lens), eos_token_id=-1, pad_token_id=0)

    def run(batch, lens) -> int:
        # A KV budget for exactly this batch: left unset, transformers takes 90% of free memory
        # (~14 GB on a 24 GB CPU box), which starves whatever runs beside the peer.
        pages = sum(-(-(len(p) + n) // 256) for p, n in zip(batch, lens))
        cb = ContinuousBatchingConfig(num_blocks=max(16, pages),
                                      max_batch_tokens=opts.get("max_num_batched_tokens") or 2048)
        manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
        manager.start()
        try:
            for i, (p, n) in enumerate(zip(batch, lens)):
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
            done = 0
            for _ in batch:
                result = manager.get_result(timeout=600)
                if result is None:
                    raise RuntimeError("continuous batching returned no result in 600 s")
                done += len(result.generated_tokens)
            return done
        finally:
            manager.stop(block=True)
            model.destroy_cached_continuous_batching_manager() if hasattr(
                model, "destroy_cached_continuous_batching_manager") else None

    with torch.inference_mode():
        run(prompts[:2], [2, 2])  # warm-up
        t0 = now()
        n_out = run(prompts, out_lens)
        dt = now() - t0
    write(out, throughput_result("hf-cb", dt, prompts, n_out))


if __name__ == "__main__":
    main()
