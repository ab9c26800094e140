"""The one place for Megatron-Core version differences and optional GPU extras.

Supported Megatron-Core: 0.16 (pinned in CI, the newest release for Python 3.11) through 0.19 (GPU users).
Everything here is cheap to import: Megatron-Core itself is imported lazily by the functions that need it.

Version differences are handled by *asking the installed code* rather than by version tables:
``supported_kwargs`` keeps only the keyword arguments a function (or dataclass) accepts, so a keyword that a
newer/older release added or removed is dropped with one log line instead of a ``TypeError`` deep inside a run.

GPU extras are detected, never required (docs/architecture.md): Transformer Engine (fused THD attention, fused
RoPE), NVIDIA Apex (fused optimizers, gradient-accumulation fusion; never the unrelated PyPI ``apex``), vLLM
(rollout). ``log_gpu_extras_once`` logs which ones were found, once per process. A Transformer Engine that is
installed but broken is the exception: Megatron-Core cannot start with it, so ``check_transformer_engine`` (run
when ``megatron_dppo.megatron`` is imported, before anything imports Megatron-Core) names it and the fix.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import inspect
import logging
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

logger = logging.getLogger(__name__)

SUPPORTED_MCORE_MIN = (0, 16)
SUPPORTED_MCORE_MAX = (0, 19)


def _parse_version(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in re.findall(r"\d+", text)[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


@functools.lru_cache(maxsize=None)
def mcore_version() -> tuple[int, int, int]:
    """Installed Megatron-Core version as (major, minor, patch), read from package metadata (no import)."""
    try:
        return _parse_version(importlib.metadata.version("megatron-core"))
    except importlib.metadata.PackageNotFoundError:
        from megatron.core import package_info  # source checkout on PYTHONPATH

        return _parse_version(package_info.__version__)


@functools.lru_cache(maxsize=None)
def check_mcore_version() -> tuple[int, int, int]:
    """Warn once when the installed Megatron-Core is outside the tested range; return its version."""
    version = mcore_version()
    if not SUPPORTED_MCORE_MIN <= version[:2] <= SUPPORTED_MCORE_MAX:
        warnings.warn(
            f"megatron-core {'.'.join(map(str, version))} is outside the tested range "
            f"{'.'.join(map(str, SUPPORTED_MCORE_MIN))}-{'.'.join(map(str, SUPPORTED_MCORE_MAX))}; "
            "megatron_dppo may still work, but this combination is untested",
            stacklevel=2,
        )
    return version


# ----------------------------------------------------------------------------------------------------------
# Keyword compatibility
# ----------------------------------------------------------------------------------------------------------
_DROPPED_LOGGED: set[tuple[str, str]] = set()

# Keywords whose loss would silently change what is trained (precision, fp32 master weights, the distributed
# optimizer, THD pipeline shapes): never dropped, whichever call passes them; a release lacking one is an error.
MUST_HONOUR = frozenset({
    "bf16", "fp16", "params_dtype", "pipeline_dtype", "main_params_dtype", "main_grads_dtype",
    "use_distributed_optimizer", "variable_seq_lengths", "grad_reduce_in_fp32", "calculate_per_token_loss",
    "context_parallel_size",
})


def supported_kwargs(target: Callable | type, kwargs: dict[str, Any], required: Iterable[str] = ()) -> dict[str, Any]:
    """Keep the keyword arguments ``target`` accepts (a function, class or dataclass).

    A dropped keyword is logged once (at INFO) so that a silently ignored option can be traced; a keyword in
    ``required`` (one that changes the model's meaning, e.g. ``qk_layernorm``) that ``target`` does not take
    raises ``RuntimeError`` naming the installed Megatron-Core version instead, and so does any keyword of
    ``MUST_HONOUR`` whatever ``required`` says. Functions taking ``**kwargs`` accept everything.
    """
    if dataclasses.is_dataclass(target):
        names = {f.name for f in dataclasses.fields(target) if f.init}
    else:
        params = inspect.signature(target).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return dict(kwargs)
        names = set(params)
    kept = {k: v for k, v in kwargs.items() if k in names}
    target_name = getattr(target, "__qualname__", repr(target))
    version = ".".join(map(str, mcore_version()))
    missing = sorted((set(required) | MUST_HONOUR) & (kwargs.keys() - kept.keys()))
    if missing:
        raise RuntimeError(f"megatron-core {version}: {target_name} does not take {missing}; this release is not "
                           f"supported (tested: {SUPPORTED_MCORE_MIN[0]}.{SUPPORTED_MCORE_MIN[1]}-"
                           f"{SUPPORTED_MCORE_MAX[0]}.{SUPPORTED_MCORE_MAX[1]})")
    for key in kwargs.keys() - kept.keys():
        if (target_name, key) not in _DROPPED_LOGGED:
            _DROPPED_LOGGED.add((target_name, key))
            logger.info("megatron-core %s: %s does not take %r; dropped", version, target_name, key)
    return kept


def call_with_supported_kwargs(fn: Callable, *args, **kwargs):
    """``fn(*args, **supported_kwargs(fn, kwargs))``."""
    return fn(*args, **supported_kwargs(fn, kwargs))


# ----------------------------------------------------------------------------------------------------------
# Megatron-Core entry points whose location or signature moved between releases
# ----------------------------------------------------------------------------------------------------------
def gpt_local_layer_spec(qk_layernorm: bool):
    """Megatron's local (pure PyTorch) GPT layer spec with RMSNorm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    kwargs = supported_kwargs(get_gpt_layer_local_spec, dict(qk_layernorm=qk_layernorm, normalization="RMSNorm"),
                              required=("qk_layernorm", "normalization"))
    return get_gpt_layer_local_spec(**kwargs)


def gpt_te_layer_spec(qk_layernorm: bool):
    """Megatron's Transformer Engine GPT layer spec (fused norm+linear, TE attention; handles THD natively)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    kwargs = supported_kwargs(get_gpt_layer_with_transformer_engine_spec, dict(qk_layernorm=qk_layernorm),
                              required=("qk_layernorm",))
    return get_gpt_layer_with_transformer_engine_spec(**kwargs)


def get_forward_backward_func():
    """The pipeline schedule for the current parallel state (signature stable 0.16-0.19)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func as _get

    return _get()


# ----------------------------------------------------------------------------------------------------------
# GPU extras
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuExtras:
    transformer_engine: str | None  # version, or None when absent
    apex: str | None  # "nvidia" when NVIDIA Apex with its CUDA kernels (amp_C) is importable
    vllm: str | None


class BrokenTransformerEngine(RuntimeError):
    """Transformer Engine is installed but importing it fails with an error other than ModuleNotFoundError."""


def installed_te_distributions() -> dict[str, str]:
    """{distribution name: version} of the installed Transformer Engine pieces (transformer-engine, its core
    library transformer-engine-cu12/-cu13, its torch binding transformer-engine-torch), from package metadata."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = re.sub(r"[-_.]+", "-", (dist.metadata["Name"] or "").lower())
        if name.startswith("transformer-engine"):
            found[name] = dist.version
    return dict(sorted(found.items()))


@functools.lru_cache(maxsize=None)
def check_transformer_engine() -> None:
    """Raise ``BrokenTransformerEngine`` when Transformer Engine is installed but ``import transformer_engine`` /
    ``transformer_engine.pytorch`` raises anything other than ModuleNotFoundError.

    Megatron-Core 0.16 wraps its TE imports in ``except ImportError``, and ``tensor_parallel/random.py`` (imported by
    ``import megatron.core``) in ``except ModuleNotFoundError`` only. So a TE that raises anything else (a core
    library without the ``transformer-engine`` package: "Could not find `transformer-engine`", an AssertionError;
    a torch binding that failed to build: FileNotFoundError; a library that does not load: ImportError; mismatched
    versions) makes ``import megatron.core`` itself fail, for every attention backend, with a traceback deep inside
    it. A TE piece that is missing (ModuleNotFoundError) passes: Megatron-Core runs without TE. Once per process;
    costs one ``find_spec`` when TE is not installed."""
    if importlib.util.find_spec("transformer_engine") is None:
        return
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401
    except ModuleNotFoundError:
        return
    except Exception as err:
        dists = installed_te_distributions()
        pieces = ", ".join(f"{n} {v}" for n, v in dists.items()) or "no distribution metadata"
        location = importlib.util.find_spec("transformer_engine").submodule_search_locations
        where = f" at {list(location)[0]}" if location else ""
        remove = " ".join(dists) or "transformer-engine transformer-engine-cu13 transformer-engine-torch"
        reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        raise BrokenTransformerEngine(
            f"Transformer Engine is installed but broken ({pieces}{where}): importing it raises {reason}. "
            "Megatron-Core catches only ModuleNotFoundError / ImportError around its Transformer Engine imports, "
            "so it cannot start. "
            "Either install every piece of one TE release (bash scripts/install_gpu.sh --te-only: the "
            "transformer-engine package, its core library and the torch binding compiled against this torch), or "
            f"remove it: pip uninstall -y {remove} (then model.attention_backend=auto runs varlen, without TE)"
        ) from err


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=None)
def detect_gpu_extras() -> GpuExtras:
    """Which GPU extras are installed. Looks at package metadata and module specs only: importing vLLM or
    Transformer Engine costs seconds and is done by the code that uses them."""
    te = None
    if importlib.util.find_spec("transformer_engine") is not None:
        te = _dist_version("transformer-engine", "transformer-engine-cu13", "transformer-engine-cu12") or "unknown"
    # PyPI's `apex` is an unrelated package; NVIDIA Apex ships the `amp_C` CUDA extension.
    apex = "nvidia" if (importlib.util.find_spec("apex") is not None
                        and importlib.util.find_spec("amp_C") is not None) else None
    vllm = _dist_version("vllm") if importlib.util.find_spec("vllm") is not None else None
    return GpuExtras(transformer_engine=te, apex=apex, vllm=vllm)


@functools.lru_cache(maxsize=None)
def have_transformer_engine() -> bool:
    """True when ``transformer_engine.pytorch`` imports (so Megatron's TE spec can be used)."""
    if detect_gpu_extras().transformer_engine is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # noqa: BLE001 - a broken TE install must not take the CPU path down
        logger.warning("transformer_engine is installed but does not import (%s); using the local spec", err)
        return False
    return True


@functools.lru_cache(maxsize=None)
def log_gpu_extras_once() -> GpuExtras:
    """Log, once per process, the Megatron-Core version and which GPU extras were found."""
    extras = detect_gpu_extras()
    found = lambda v: v if v else "not found"  # noqa: E731
    logger.info(
        "megatron-core %s; GPU extras: transformer_engine=%s, apex=%s, vllm=%s",
        ".".join(map(str, check_mcore_version())), found(extras.transformer_engine), found(extras.apex),
        found(extras.vllm),
    )
    return extras
