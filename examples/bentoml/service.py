"""The BentoML service, as `bentoml serve service:PagedCore` and `bentoml build` expect to find it.

The service itself lives in the installed package (pagedcore/adapters/bentoml_service.py); engine
settings come from PAGEDCORE_<FIELD> variables (PAGEDCORE_MODEL, PAGEDCORE_DTYPE, ...).
"""

from pagedcore.adapters.bentoml_service import PagedCore

__all__ = ["PagedCore"]
