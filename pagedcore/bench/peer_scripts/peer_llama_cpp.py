"""Peer: llama.cpp through llama-cpp-python on the same GGUF (4-bit weights), one stream at a time
(its server serialises requests: no continuous batching)."""

from _peer_common import load_spec, now, stream_timings, throughput_result, write


def main() -> None:
    spec, out = load_spec()
    from llama_cpp import Llama

    threads = spec.get("threads") or None
    llm = Llama(model_path=spec["gguf_path"], n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False)
    prompts, out_lens = spec["prompts"], spec["output_lens"]

    def generate(prompt, n, on_token=None):
        llm.reset()  # no reuse of the previous prompt's cache between requests
        count = 0
        for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            count += 1
            if on_token:
                on_token()
            if count >= n:  # exact length: EOS is not a stop here
                break
        return count

    generate(prompts[0][:8], 2)  # warm-up
    if spec["mode"] == "single_stream":
        times: list[float] = []
        t0 = now()
        generate(prompts[0], out_lens[0], lambda: times.append(now()))
        write(out, stream_timings("llama-cpp", times, t0, threads=threads))
        return
    t0 = now()
    n_out = sum(generate(p, n) for p, n in zip(prompts, out_lens))
    write(out, throughput_result("llama-cpp", now() - t0, prompts, n_out, threads=threads))


if __name__ == "__main__":
    main()
