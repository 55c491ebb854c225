"""`pagedcore bench ...`: every benchmark of pagedcore, here and nowhere else (results go to benchmarks/results/).

throughput (offline, with peers), step (a decode step's time by part), linears (each linear shape vs the
machine's ceilings), attention (one attention layer's decode step, per kernel), serve (online, Poisson,
through the front doors, launched as `pagedcore serve-*` processes), soak (hostile traffic through the
front doors, then no leaks), memory (KV waste, concurrency, sharing), prefix (TTFT with a shared prompt),
spec (speculative decoding on vs off), lora (1/4/16 LoRA adapters mixed vs the base model), plot and report (PNG, README table from JSON).
setup_peers.sh installs the peer engines, each in a virtualenv of its own.

The benchmarks are clients of the engine and its front doors; nothing in the engine imports them.
"""

from __future__ import annotations


def add_command_arguments(b) -> None:
    """`pagedcore bench` (pagedcore/cli.py imports this package only for that subcommand)."""
    from pagedcore.bench import (attention, linears, lora, memory, plot, prefix, report, serve, soak, spec,
                                 step_profile, throughput)

    bsub = b.add_subparsers(dest="bench_command", required=True)
    for module in (throughput, step_profile, linears, attention, serve, soak, memory, prefix, spec, lora, plot,
                   report):
        module.add_parser(bsub)
