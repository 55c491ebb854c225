"""Triton loads this file; the model lives in the pagedcore package (adapters/triton_backend.py)."""

from pagedcore.adapters.triton_backend import TritonPythonModel

__all__ = ["TritonPythonModel"]
