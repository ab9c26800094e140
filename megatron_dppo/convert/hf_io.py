"""Reading and writing Hugging Face checkpoint folders (safetensors + config.json + tokenizer files).

``HFCheckpoint``  lazy reader: tensor names and shapes from the safetensors headers, tensors loaded on demand.
``write_safetensors_shards``  streams (name, tensor) pairs into size-bounded safetensors files (+ index).
``copy_tokenizer_files``      tokenizer / chat template / generation config files that travel with a model.
``portable_config``           config.json readable by transformers 5 and 4.x (vLLM).
``read_config_json``          a folder's config.json as a dict; a file that is not a JSON object is an error naming it.
``check_output_dir``          before a conversion: its output folder is free and can be created (not under a file,
                              on a writable file system); the error names the folder and what to change.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import Tensor

# Files that travel with a checkpoint besides weights and config.json: tokenizer, chat template, generation defaults.
TOKENIZER_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                      "chat_template*", "generation_config.json", "preprocessor_config.json")


def tokenizer_files(folder: str | os.PathLike) -> list[Path]:
    """Tokenizer / generation files in ``folder`` (see TOKENIZER_PATTERNS)."""
    folder = Path(folder)
    found = {p for pattern in TOKENIZER_PATTERNS for p in folder.glob(pattern) if p.is_file()}
    return sorted(found)


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object in ``path`` (a config.json). ValueError naming the file when it is not UTF-8, not JSON (with
    line and column) or not an object."""
    path = Path(path)
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not valid UTF-8 (byte 0x{err.object[err.start]:02x} at byte offset {err.start}); "
                         "a config.json is UTF-8 JSON as save_pretrained writes it") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); a "
                         "config.json is the model's Hugging Face config as save_pretrained writes it") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object (the model's Hugging Face config), got "
                         f"{type(config).__name__}")
    return config


def check_output_dir(out_dir: str | os.PathLike, overwrite: bool) -> None:
    """Raise ValueError unless a conversion can write ``out_dir``: it does not exist (or ``overwrite`` and it is a
    folder), and its nearest existing ancestor is a folder in which a folder can be created (tried: a read-only
    or pseudo file system such as /proc refuses even root, for whom os.access says yes)."""
    out_dir = Path(out_dir).absolute()
    if out_dir.exists() or out_dir.is_symlink():
        if not overwrite:
            raise ValueError(f"output directory already exists: {out_dir} (pass overwrite=True / --overwrite)")
        if not out_dir.is_dir():
            raise ValueError(f"output directory {out_dir} is a file, not a folder: choose another output folder or "
                             "remove the file")
    ancestor = out_dir.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"cannot create the output directory {out_dir}: {ancestor} is a file, not a folder; choose "
                         "an output folder elsewhere")
    try:
        probe = tempfile.mkdtemp(prefix=f".{out_dir.name}.write-check-", dir=ancestor)
    except OSError as err:
        raise ValueError(f"cannot create the output directory {out_dir}: {ancestor} is not writable "
                         f"({err.strerror or err}); choose a writable output folder") from None
    os.rmdir(probe)


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    names = []
    for path in tokenizer_files(src):
        shutil.copy2(path, Path(dst) / path.name)
        names.append(path.name)
    return names


class HFCheckpoint:
    """A Hugging Face model folder read lazily: ``.config`` (dict), ``.shapes`` (name -> shape), ``.get(name)``."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        config_path = self.folder / "config.json"
        if not config_path.is_file():
            raise ValueError(f"not a Hugging Face model folder: {self.folder} has no config.json")
        self.config: dict[str, Any] = read_config_json(config_path)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{index}: not a safetensors index (a JSON object with a 'weight_map'): "
                                 f"{type(err).__name__}: {err}") from None
            files = sorted(set(weight_map.values()))
            absent = [name for name in files if not (self.folder / name).is_file()]
            if absent:
                raise ValueError(f"{index} names shard file(s) that do not exist: {', '.join(absent)} "
                                 f"({sum(v in absent for v in weight_map.values())} tensors); the download or "
                                 "copy is incomplete")
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not files:
            extra = " (found pytorch_model*.bin: re-save it with safe_serialization=True)" \
                if list(self.folder.glob("pytorch_model*.bin")) else ""
            raise ValueError(f"no safetensors weights in {self.folder}{extra}")

        self._file_of: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for name in files:
            path = self.folder / name
            with _open_safetensors(path) as f:
                for key in f.keys():
                    if key in self._file_of:
                        raise ValueError(f"tensor {key!r} appears in both {self._file_of[key].name} and {name}")
                    self._file_of[key] = path
                    sl = f.get_slice(key)
                    self.shapes[key] = tuple(sl.get_shape())
                    self.dtypes[key] = sl.get_dtype()
        self._open: dict[Path, Any] = {}

    def get(self, name: str) -> Tensor:
        """The full tensor ``name`` (KeyError when absent)."""
        if name not in self._file_of:
            raise KeyError(name)
        path = self._file_of[name]
        if path not in self._open:
            self._open[path] = _open_safetensors(path)
        return self._open[path].get_tensor(name)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of


def _open_safetensors(path: Path):
    """``safe_open(path)``; a truncated or corrupt file (safetensors checks that the header parses and that the
    tensors' byte ranges cover the file exactly) is a ValueError naming it and its size."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} ({path.stat().st_size} bytes) is not a readable safetensors file: {err}; the "
                         "file is truncated or corrupt (re-download or re-copy it)") from None


def write_safetensors_shards(tensors: Iterable[tuple[str, Tensor]], folder: Path,
                             max_shard_bytes: int = 5 * 1024 ** 3) -> dict[str, str]:
    """Write (name, tensor) pairs into ``model-0000i-of-0000n.safetensors`` files of at most ``max_shard_bytes``
    (``model.safetensors`` when one file suffices) plus ``model.safetensors.index.json``; returns name -> file.

    Holds at most one shard in memory. Duplicate names raise ValueError.
    """
    from safetensors.torch import save_file

    shard: dict[str, Tensor] = {}
    shard_bytes = 0
    files: list[tuple[str, list[str]]] = []
    total = 0
    seen: set[str] = set()

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"part-{len(files):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        files.append((name, list(shard)))
        shard, shard_bytes = {}, 0

    for name, tensor in tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} written twice")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor.detach().to("cpu").contiguous()
        shard_bytes += nbytes
        total += nbytes
    if shard or not files:
        flush()

    weight_map: dict[str, str] = {}
    n = len(files)
    for i, (tmp_name, names) in enumerate(files):
        final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(folder / tmp_name, folder / final)
        weight_map.update({k: final for k in names})
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


def torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def portable_config(cfg: dict[str, Any], dtype: torch.dtype | None = None) -> dict[str, Any]:
    """config.json readable by transformers 5 *and* 4.x (which vLLM releases may pin).

    transformers 5 writes RoPE as ``rope_parameters`` and the dtype as ``dtype``; 4.x reads top-level
    ``rope_theta`` (silently defaulting to 10000 without it: wrong positions) and ``torch_dtype``. Both spellings
    are written; transformers 5 reads the legacy keys consistently (checked in tests/convert).
    """
    out = dict(cfg)
    params = out.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params and "rope_theta" not in out:
        out["rope_theta"] = params["rope_theta"]
        if params.get("rope_type", "default") != "default" and "rope_scaling" not in out:
            out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    if dtype is not None:
        out["dtype"] = out["torch_dtype"] = torch_dtype_name(dtype)
    elif "dtype" in out and "torch_dtype" not in out:
        out["torch_dtype"] = out["dtype"]
    return out


PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # transformers 5 saves "TokenizersBackend", unknown to 4.x


def make_tokenizer_config_portable(folder: str | os.PathLike) -> None:
    """Rewrite a transformers-5-only ``tokenizer_class`` in ``tokenizer_config.json`` to the portable name."""
    path = Path(folder) / "tokenizer_config.json"
    if not path.is_file() or not (Path(folder) / "tokenizer.json").is_file():
        return
    cfg = json.loads(path.read_text())
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = PORTABLE_TOKENIZER_CLASS
        path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
