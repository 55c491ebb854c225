"""`bench throughput --repeats N`: the offline workload run again in fresh engines and peer processes, each engine's
fastest run kept (timeit's convention: a shared host's noise only ever slows a run) with every run's seconds."""

from __future__ import annotations

from collections.abc import Callable


def best_run(runs: list[dict]) -> dict:
    """An engine's fastest offline run, with every run's seconds beside it."""
    best = dict(min(runs, key=lambda r: r["seconds"]))
    best["seconds_samples"] = [round(r["seconds"], 3) for r in runs]
    return best


def repeat_offline(report: dict, times: int, run_ours: Callable[[], dict], run_peer_row: Callable[[object], dict],
                   peers) -> None:
    """Run the offline workload `times` more (pagedcore, then every peer that ran, each round) and keep each engine's
    fastest run in report["results"]; the roofline follows pagedcore's fastest."""
    runs = {r["peer"]: [r] for r in report["results"] if "seconds" in r}
    by_name = {p.name: p for p in peers}
    for _ in range(times):
        runs["pagedcore"].append(run_ours())
        for name in [n for n in runs if n in by_name]:
            row = run_peer_row(by_name[name])
            if "seconds" in row:
                runs[name].append(row)
    first = report["results"][0]["seconds"]
    report["results"] = [best_run(runs[r["peer"]]) if r["peer"] in runs else r for r in report["results"]]
    rf = report.get("roofline")
    if rf:
        faster = first / report["results"][0]["seconds"]
        for key in ("achieved_tflops", "matmul_fraction", "fraction"):
            if key in rf:
                rf[key] *= faster
