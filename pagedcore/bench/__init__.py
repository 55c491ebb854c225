"""`pagedcore bench ...`: benchmarks of the engine against peer engines measured in the same run.

throughput (offline, with peers), step (a decode step's time by part), linears (each linear shape vs the machine's ceilings), serve (online, Poisson, through the front doors), memory (KV waste,
concurrency, sharing), prefix (TTFT with a shared prompt), plot and report (PNG, README table from JSON).
"""

from __future__ import annotations


def add_parser(sub) -> None:
    from pagedcore.bench import linears, memory, plot, prefix, report, serve, step_profile, throughput

    b = sub.add_parser("bench", help="benchmarks against peers measured in the same run")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    for module in (throughput, step_profile, linears, serve, memory, prefix, plot, report):
        module.add_parser(bsub)
