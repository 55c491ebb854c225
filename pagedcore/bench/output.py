"""What every `pagedcore bench` command shares on its way out: the JSON report, comma lists."""

from __future__ import annotations

import json
import sys


def write_json(report: dict, path: str | None) -> None:
    """The report as indented JSON at `path` (nothing without one), and a line on stderr saying so."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {path}", file=sys.stderr)


def int_list(text: str) -> list[int]:
    """argparse type for "1,4,16"."""
    return [int(x) for x in text.split(",") if x]
