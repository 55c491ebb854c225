"""`pagedcore` command line: generate, serve-bentoml, serve-triton, bench.

Each subcommand's arguments are added, by importing the module that owns them, only when that
subcommand is the one run: `pagedcore --help` and `pagedcore generate` import neither the front
doors nor the benchmarks (dependencies point one way: adapters -> engine -> kernels).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from pagedcore.settings import add_engine_arguments

    add_engine_arguments(p)  # one flag per EngineConfig field, its comment as help


def _engine_settings(args) -> dict:
    from pagedcore.settings import settings_from_args

    return settings_from_args(args)


def cmd_generate(args) -> int:
    from pagedcore import LLM, SamplingParams

    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("error: give at least one prompt (or --prompts-file)", file=sys.stderr)
        return 2
    # Validate the sampling flags before loading the model: a bad value fails at once.
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            max_tokens=args.max_tokens, seed=args.seed, n=args.n, stop=args.stop or [])
    t0 = time.perf_counter()
    llm = LLM(**_engine_settings(args))
    load_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    use_chat = not args.no_chat and getattr(tok, "chat_template", None)
    inputs = [llm.apply_chat_template([{"role": "user", "content": p}]) if use_chat else p for p in prompts]
    t1 = time.perf_counter()
    outputs = llm.generate(inputs, params, lora_request=args.lora)  # a name among --lora-modules, or None
    gen_s = time.perf_counter() - t1
    n_tokens = sum(len(o.token_ids) for r in outputs for o in r.outputs)
    for prompt, r in zip(prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "outputs": [
                {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason} for o in r.outputs]}))
        else:
            for o in r.outputs:
                print(f"### {prompt}\n{o.text}\n")
    print(f"[pagedcore] {len(prompts)} prompt(s), {n_tokens} tokens in {gen_s:.2f} s "
          f"({n_tokens / gen_s:.1f} tok/s); engine start {load_s:.2f} s; "
          f"KV cache {llm.engine.kv.num_blocks} blocks = {llm.engine.kv.num_blocks * llm.engine.config.block_size} tokens",
          file=sys.stderr)
    return 0


BENTOML_SERVICE = "pagedcore.adapters.bentoml_service:PagedCore"


def cmd_serve_bentoml(args) -> int:
    """Exec `bentoml serve` on the pagedcore service; engine flags travel as PAGEDCORE_* variables
    (only those given, so variables already set keep their say)."""
    import os

    from pagedcore.extras import require

    require("bentoml", "pagedcore serve-bentoml")
    env = dict(os.environ)
    env.update({f"PAGEDCORE_{k.upper()}": json.dumps(v) if isinstance(v, dict) else str(v)
                for k, v in _engine_settings(args).items()})
    argv = [sys.executable, "-m", "bentoml", "serve", BENTOML_SERVICE, "--host", args.host, "--port", str(args.port)]
    os.execvpe(sys.executable, argv, env)
    return 0  # reached only when exec is stubbed out (tests)


def add_generate_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("prompt", nargs="*", help="prompt text (chat template applied for chat models)")
    g.add_argument("--prompts-file", help="one prompt per line")
    g.add_argument("--max-tokens", type=int, default=64, help="new tokens per output at most (default 64)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 (the default) picks the most likely token; higher samples more freely")
    g.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of tokens whose "
                   "probabilities add up to this (nucleus sampling; default 1: all)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (default 0: all)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this fraction of the most likely one (default 0)")
    g.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    g.add_argument("-n", type=int, default=1, help="outputs per prompt (default 1)")
    g.add_argument("--stop", action="append", help="stop at this string (repeat for several)")
    g.add_argument("--no-chat", action="store_true", help="send prompts raw, without the chat template")
    g.add_argument("--lora", default=None, metavar="NAME",
                   help="run the prompts under this LoRA adapter (one of --lora-modules; needs --enable-lora)")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    _add_engine_args(g)
    g.set_defaults(func=cmd_generate)


def add_serve_bentoml_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--host", default="127.0.0.1")
    b.add_argument("--port", type=int, default=3000)
    _add_engine_args(b)
    b.set_defaults(func=cmd_serve_bentoml)


# name -> (help, what adds the subcommand's arguments and sets its `func`: a function here, or
# "module:function" for a module imported only when the subcommand runs)
COMMANDS = {
    "generate": ("generate text for one or more prompts", add_generate_arguments),
    "serve-bentoml": ("serve the OpenAI-compatible API through BentoML (bentoml serve)", add_serve_bentoml_arguments),
    "serve-triton": ("serve through NVIDIA Triton Inference Server (gRPC, HTTP generate)",
                     "pagedcore.adapters.triton_launcher:add_command_arguments"),
    "bench": ("benchmarks against peers measured in the same run", "pagedcore.bench:add_command_arguments"),
}


class LazySubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser that gets its arguments (importing the module that owns them) when it
    first parses: only the subcommand being run is ever loaded."""

    def __init__(self, *args, add_arguments=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._add_arguments = add_arguments

    def parse_known_args(self, args=None, namespace=None):
        add_arguments, self._add_arguments = self._add_arguments, None
        if isinstance(add_arguments, str):
            from pagedcore import gc_paused

            module, _, name = add_arguments.partition(":")
            with gc_paused():  # bench and the launcher import torch (which the command needs anyway)
                add_arguments = getattr(importlib.import_module(module), name)
        if add_arguments is not None:
            add_arguments(self)
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedcore", description="pagedcore LLM inference engine")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=LazySubcommandParser)
    for name, (help, add_arguments) in COMMANDS.items():
        sub.add_parser(name, help=help, add_arguments=add_arguments)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
