"""Optional dependencies: a front door without its extra fails with one line naming the install."""

from __future__ import annotations

import importlib.util

EXTRAS = {  # extra -> the modules it provides that pagedcore imports
    "bentoml": ("bentoml", "fastapi"),
    "triton-server": ("pytriton",),
}


class MissingExtraError(ValueError):
    """ValueError: the CLI prints it as one `error:` line and exits 2."""


def require(extra: str, purpose: str) -> None:
    missing = [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(
            f"{purpose} needs {', '.join(missing)}: pip install 'pagedcore[{extra}]' "
            f"(in a checkout: .venv/bin/pip install -e '.[{extra}]')")
