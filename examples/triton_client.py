"""Stream tokens from pagedcore behind Triton over gRPC (tritonclient start_stream / async_stream_infer).

    pagedcore serve-triton                      # in another terminal: HTTP 8000, gRPC 8001, metrics 8002
    python examples/triton_client.py "Write a haiku about the sea." --max-tokens 64
    python examples/triton_client.py "Describe a person." --json-schema '{"type": "object", "properties":
        {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}'
    python examples/triton_client.py "Is the sea blue?" --choice yes no

Structured output goes in `sampling_parameters` as vLLM's `structured_outputs` ({"json": schema},
{"regex": ...}, {"choice": [...]}, {"grammar": ebnf}, {"json_object": true}).

The server takes `text_input` as is; the chat template is applied here (with the bundled model's
tokenizer unless --tokenizer names another, or not at all with --no-chat).
"""

from __future__ import annotations

import argparse
import json
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient


def chat_prompt(question: str, tokenizer: str | None) -> str:
    from transformers import AutoTokenizer

    if tokenizer is None:
        from pagedcore.model_loader import resolve_model_dir

        tokenizer = str(resolve_model_dir(None))
    tok = AutoTokenizer.from_pretrained(tokenizer)
    return tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)


def make_inputs(prompt: str, sampling_parameters: dict) -> list:
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    stream = grpcclient.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    params = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([json.dumps(sampling_parameters).encode()], dtype=object))
    return [text, stream, params]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("prompt")
    p.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC address")
    p.add_argument("--model", default="pagedcore")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--tokenizer", default=None, help="HF tokenizer for the chat template (default: the bundled model's)")
    p.add_argument("--no-chat", action="store_true", help="send the prompt raw")
    constrain = p.add_mutually_exclusive_group()
    constrain.add_argument("--json-schema", help="constrain the output to this JSON schema (JSON text)")
    constrain.add_argument("--regex", help="constrain the output to this regular expression")
    constrain.add_argument("--choice", nargs="+", help="the output is exactly one of these strings")
    args = p.parse_args()
    sampling_parameters = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.json_schema:
        sampling_parameters["structured_outputs"] = {"json": json.loads(args.json_schema)}
    elif args.regex:
        sampling_parameters["structured_outputs"] = {"regex": args.regex}
    elif args.choice:
        sampling_parameters["structured_outputs"] = {"choice": args.choice}

    prompt = args.prompt if args.no_chat else chat_prompt(args.prompt, args.tokenizer)
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(args.model, make_inputs(prompt, sampling_parameters), enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=300)
            if error is not None:
                print(f"\nerror: {error}", file=sys.stderr)
                return 1
            text = result.as_numpy("text_output")
            if text is not None:
                print(text[0].decode(), end="", flush=True)
            if result.get_response().parameters["triton_final_response"].bool_param:
                reason = result.as_numpy("finish_reason")
                print(f"\n[finish_reason: {reason[0].decode() if reason is not None else '?'}]", file=sys.stderr)
                return 0
    finally:
        client.stop_stream()
        client.close()


if __name__ == "__main__":
    sys.exit(main())
