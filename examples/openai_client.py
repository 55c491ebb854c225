"""Streaming chat through the official `openai` client against `pagedcore serve-bentoml`.

    pagedcore serve-bentoml --port 3000 &
    python examples/openai_client.py --base-url http://127.0.0.1:3000/v1 "Write a haiku about the sea."
"""

import argparse

from openai import OpenAI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("question", nargs="?", default="What is the capital of France?")
    ap.add_argument("--base-url", default="http://127.0.0.1:3000/v1")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()

    client = OpenAI(base_url=args.base_url, api_key="unused")  # the server checks no key
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": args.question}], max_completion_tokens=args.max_tokens,
        temperature=0.7, stream=True, stream_options={"include_usage": True},
        extra_body={"top_k": 50},  # engine extras ride along as extra body fields
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]")


if __name__ == "__main__":
    main()
