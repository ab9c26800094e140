"""The CPU backend: run Megatron-Core (TP, PP, DP, SP over gloo) on a machine without CUDA.

Megatron-Core assumes CUDA in a handful of places. ``apply_cpu_backend()`` redirects each of them, once per
process, and is called automatically by ``megatron_dppo.megatron.parallel`` and ``.model`` whenever
``torch.cuda.is_available()`` is False, so developers can run and debug the whole stack on a laptop. On a GPU
machine nothing here is applied and Megatron runs unmodified.

Every redirection is a small named function below, listed in ``_PATCHES`` in the order it is applied:

==============================  ==========================================================================
``_redirect_cuda_device_calls`` ``torch.cuda.current_device()`` -> ``torch.device("cpu")``;
                                ``torch.cuda.synchronize()`` -> no-op; ``Tensor.cuda()`` -> the tensor itself.
                                (Without CUDA each of these raises, so redirecting them changes no working
                                behaviour.)
``_cpu_rng_tracker``            Megatron's CUDA RNG tracker (``get_cuda_rng_tracker``,
                                ``model_parallel_cuda_manual_seed``, activation-recompute RNG save/restore)
                                keeps CPU generator states instead of CUDA ones; the default generator is
                                seeded with the data-parallel seed exactly as ``torch.cuda.manual_seed`` is.
``_cpu_device_literals``        ``device="cuda"`` literals inside Megatron (causal mask, optimizer found-inf and
                                scale buffers, grad clipping / norms, pipeline token counts, ...): the listed
                                modules see a view of ``torch`` whose tensor factories map CUDA devices to CPU.
``_accept_cpu_float_tensors``   ``param.type()`` checks for ``'torch.cuda.FloatTensor'`` / ``HalfTensor`` /
                                ``BFloat16Tensor`` in the mixed-precision optimizers
                                (``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``) and
                                ``clip_grad_by_total_norm_fp32`` also accept the CPU spellings.
``_torch_norm_sequence_parallel`` ``WrappedTorchNorm`` (the local spec's RMSNorm/LayerNorm) accepts sequence
                                parallel and marks its weights ``sequence_parallel`` so their gradients are
                                all-reduced over the TP group, as Transformer Engine's norms do.
==============================  ==========================================================================

Model flags that must be off on CPU are set by ``model.build_transformer_config``:
``gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
masked_softmax_fusion=False, bias_activation_fusion=False, use_cpu_initialization=True``. Parameters are in the
engine's dtype: fp32, or bf16 / fp16 with Megatron's mixed-precision optimizers (fp32 main params and Adam state;
fp16 with its dynamic loss scaler, whose found-inf buffer the device literals put on the CPU; without Apex or
Transformer Engine Megatron copies and scales with its own ``local_multi_tensor_*`` loops, which run on CPU).

Limits on CPU: no CUDA graphs, no Megatron FSDP, no fused kernels (Transformer Engine, Apex).

Bump ``CPU_BACKEND_VERSION`` whenever the set or meaning of the redirections changes.

Other engine modules may register more redirections at the end of this file (see the marked section) with
``register_cpu_patch``; they run after the core ones, in registration order.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import sys
import textwrap
import types
from typing import Callable

import torch

logger = logging.getLogger(__name__)

CPU_BACKEND_VERSION = 2

_APPLIED = False
_PATCHES: list[Callable[[], None]] = []
_ORIGINALS: dict[str, object] = {}  # what was replaced, for inspection in tests and debugging


def cuda_available() -> bool:
    return torch.cuda.is_available()


def cpu_backend_applied() -> bool:
    return _APPLIED


def register_cpu_patch(fn: Callable[[], None]) -> Callable[[], None]:
    """Add a redirection (a no-argument function) to the CPU backend. Usable as a decorator.

    When the backend has already been applied in this process, the new patch runs immediately.
    """
    _PATCHES.append(fn)
    if _APPLIED:
        fn()
    return fn


def apply_cpu_backend(force: bool = False) -> None:
    """Apply every CPU redirection once per process (idempotent). Safe to call before or after
    ``import megatron.core``. On a machine with CUDA it refuses (the redirections would break CUDA use) unless
    ``force``; ``ensure_device_backend`` is the automatic entry point."""
    global _APPLIED
    if _APPLIED:
        return
    if cuda_available() and not force:
        raise RuntimeError("CUDA is available: the CPU backend would redirect torch.cuda calls of this process to "
                           "the CPU; call apply_cpu_backend(force=True) to apply it anyway")
    for patch in _PATCHES:
        patch()
    _APPLIED = True
    logger.info("megatron_dppo CPU backend v%d applied (%d redirections)", CPU_BACKEND_VERSION, len(_PATCHES))


def ensure_device_backend() -> str:
    """Apply the CPU backend when CUDA is absent. Returns the device type the engine runs on: "cuda" | "cpu"."""
    if cuda_available():
        return "cuda"
    apply_cpu_backend()
    return "cpu"


# ----------------------------------------------------------------------------------------------------------
# Helpers for redirections (also for the optimizer/checkpoint section at the end)
# ----------------------------------------------------------------------------------------------------------
def _replace_everywhere(old, new) -> int:
    """Rebind every ``megatron.*`` module attribute that is ``old`` to ``new`` (covers ``from x import f``)."""
    count = 0
    for mod_name, module in list(sys.modules.items()):
        if module is None or not mod_name.startswith("megatron."):
            continue
        for attr, value in list(vars(module).items()):
            if value is old:
                setattr(module, attr, new)
                count += 1
    return count


def rewrite_source(owner, name: str, replacements: list[tuple[str, str]]) -> bool:
    """Recompile ``owner.name`` (a module function, method, classmethod or staticmethod) from its source with
    textual ``replacements`` applied, in its own module's globals. Returns False (and logs a warning, leaving
    the original in place) when a replacement's text is not found, e.g. in another Megatron-Core release.

    A method of a class (``owner`` a class) is recompiled inside a class body of the same name, so that a
    zero-argument ``super()`` and name mangling work; its ``__class__`` cell is then pointed at ``owner``.
    """
    raw = inspect.getattr_static(owner, name)
    func = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    source = textwrap.dedent(inspect.getsource(func))
    for old, new in replacements:
        if old not in source:
            logger.warning("CPU backend: %r not found in %s.%s; left unpatched", old, func.__module__,
                           func.__qualname__)
            return False
        source = source.replace(old, new)
    module = sys.modules[func.__module__]
    # Keep the original file name and line numbers so that tracebacks point at the real source.
    _, start = inspect.getsourcelines(func)
    in_class = isinstance(owner, type)
    if in_class:
        source = f"class {owner.__name__}:\n" + textwrap.indent(source, "    ")
        start -= 1
    code = compile("\n" * max(start - 1, 0) + source, inspect.getsourcefile(func) or "<rewritten>", "exec")
    namespace: dict = {}
    exec(code, module.__dict__, namespace)  # noqa: S102 - our own transformation of installed source
    new = vars(namespace[owner.__name__])[name] if in_class else namespace[name]
    new_func = new.__func__ if isinstance(new, (classmethod, staticmethod)) else new
    if "__class__" in new_func.__code__.co_freevars:  # zero-argument super(): the real class, not the shell
        new_func.__closure__[new_func.__code__.co_freevars.index("__class__")].cell_contents = owner
    new_func.__qualname__ = func.__qualname__
    _ORIGINALS[f"{func.__module__}.{func.__qualname__}"] = raw
    setattr(owner, name, new)
    if isinstance(owner, types.ModuleType):
        _replace_everywhere(raw, new)
    return True


# ----------------------------------------------------------------------------------------------------------
# 1. torch.cuda device calls
# ----------------------------------------------------------------------------------------------------------
def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _cpu_synchronize(device=None) -> None:
    return None


def _tensor_cuda_on_cpu(self: torch.Tensor, device=None, non_blocking: bool = False,
                        memory_format=torch.preserve_format) -> torch.Tensor:
    return self


def _redirect_cuda_device_calls() -> None:
    _ORIGINALS.setdefault("torch.cuda.current_device", torch.cuda.current_device)
    _ORIGINALS.setdefault("torch.cuda.synchronize", torch.cuda.synchronize)
    _ORIGINALS.setdefault("torch.Tensor.cuda", torch.Tensor.cuda)
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _cpu_synchronize
    torch.Tensor.cuda = _tensor_cuda_on_cpu


_PATCHES.append(_redirect_cuda_device_calls)


# ----------------------------------------------------------------------------------------------------------
# 2. The RNG tracker keeps CPU generator states
# ----------------------------------------------------------------------------------------------------------
def _cpu_rng_tracker() -> None:
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    original_tracker = mrandom.CudaRNGStatesTracker
    if getattr(original_tracker, "_megatron_dppo_cpu", False):
        return

    class CpuRNGStatesTracker(original_tracker):  # type: ignore[valid-type, misc]
        """Megatron's RNG tracker with CPU generator states: ``fork(name)`` swaps the CPU default generator
        to the named state and back, exactly as the CUDA tracker swaps the CUDA generator."""

        _megatron_dppo_cpu = True

        def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
            super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=is_inference_rng_tracker)

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig_state = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    def _get_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def _set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    original_seed = mrandom.model_parallel_cuda_manual_seed

    def model_parallel_cuda_manual_seed(seed: int, *args, **kwargs):
        """CPU twin of Megatron's ``model_parallel_cuda_manual_seed``: the tracked states are CPU generator
        states and the default generator gets the data-parallel seed (``seed``)."""
        kwargs.pop("te_rng_tracker", None)  # TE's tracker needs CUDA
        kwargs.pop("use_cudagraphable_rng", None)
        result = original_seed(seed, *args, **kwargs)
        torch.manual_seed(seed)
        return result

    _ORIGINALS["tensor_parallel.random.CudaRNGStatesTracker"] = original_tracker
    _ORIGINALS["tensor_parallel.random.model_parallel_cuda_manual_seed"] = original_seed
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom._get_cuda_rng_state = _get_rng_state
    mrandom._set_cuda_rng_state = _set_rng_state
    _replace_everywhere(original_seed, model_parallel_cuda_manual_seed)
    tensor_parallel.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed
    # A tracker built before the patch holds CUDA states; drop it so the next use builds a CPU one.
    if mrandom._CUDA_RNG_STATE_TRACKER is not None and not isinstance(mrandom._CUDA_RNG_STATE_TRACKER,
                                                                      CpuRNGStatesTracker):
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


_PATCHES.append(_cpu_rng_tracker)


# ----------------------------------------------------------------------------------------------------------
# 3. device="cuda" literals inside Megatron modules
# ----------------------------------------------------------------------------------------------------------
# Modules whose functions create tensors with a literal CUDA device on the paths we use (0.16.1):
CUDA_LITERAL_MODULES = (
    "megatron.core.transformer.utils",  # get_default_causal_mask, get_sliding_window_causal_mask
    "megatron.core.optimizer.optimizer",  # found_inf, _dummy_overflow_buf, _scale_one, _scale
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.clip_grads",  # total_norm, dummy_overflow_buf, grad_norm, num_zeros
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens
    "megatron.core.utils",  # local_multi_tensor_l2_norm
    "megatron.core.rerun_state_machine",
    "megatron.core.tensor_parallel.data",  # broadcast_data
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.exchange_utils",
)

_FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
              "zeros_like", "ones_like", "empty_like", "full_like", "eye", "linspace")


def _to_cpu_device(device):
    """Map a CUDA device spec (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``, an int index) to CPU."""
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _cpu_factory(fn):
    def factory(*args, **kwargs):
        if "device" in kwargs:
            device = _to_cpu_device(kwargs["device"])
            if device != kwargs["device"]:
                kwargs["device"] = device
                kwargs.pop("pin_memory", None)  # pinning needs CUDA
        return fn(*args, **kwargs)

    factory.__name__ = fn.__name__
    factory.__doc__ = f"CPU-backend view of torch.{fn.__name__}: CUDA devices map to CPU."
    return factory


class _TorchOnCpu(types.ModuleType):
    """``torch`` as seen by a Megatron module under the CPU backend: tensor factories map CUDA devices to
    the CPU; every other attribute is torch's own (``isinstance(x, torch.Tensor)`` etc. are unchanged)."""

    def __init__(self):
        super().__init__("torch", "CPU-backend view of torch (megatron_dppo.megatron.cpu)")
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


_TORCH_ON_CPU: _TorchOnCpu | None = None


def _cpu_device_literals() -> None:
    global _TORCH_ON_CPU
    if _TORCH_ON_CPU is None:
        _TORCH_ON_CPU = _TorchOnCpu()
    for name in CUDA_LITERAL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as err:  # moved or removed in another Megatron-Core release
            logger.debug("CPU backend: %s not importable (%s); skipped", name, err)
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = _TORCH_ON_CPU


_PATCHES.append(_cpu_device_literals)


# ----------------------------------------------------------------------------------------------------------
# 4. torch.cuda.{Float,Half,BFloat16}Tensor type checks
# ----------------------------------------------------------------------------------------------------------
_CUDA_FLOAT_CHECK = ("== 'torch.cuda.FloatTensor'", "in ('torch.cuda.FloatTensor', 'torch.FloatTensor')")
_CUDA_HALF_CHECK = ("in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']",
                    "in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor', 'torch.HalfTensor', "
                    "'torch.BFloat16Tensor']")


def _accept_cpu_float_tensors() -> None:
    """The mixed-precision optimizers sort parameters by ``param.type()`` strings: fp16/bf16 ones get an fp32
    main copy, fp32 ones are stepped as they are, anything else is refused. The CPU spellings join each list."""
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    rewrite_source(optimizer.Float16OptimizerWithFloat16Params, "__init__", [_CUDA_HALF_CHECK, _CUDA_FLOAT_CHECK])
    rewrite_source(distrib_optimizer.DistributedOptimizer, "__init__", [_CUDA_HALF_CHECK])
    rewrite_source(distrib_optimizer.DistributedOptimizer, "_build_model_and_main_param_groups",
                   [_CUDA_HALF_CHECK, _CUDA_FLOAT_CHECK])
    rewrite_source(clip_grads, "clip_grad_by_total_norm_fp32", [_CUDA_FLOAT_CHECK])


_PATCHES.append(_accept_cpu_float_tensors)


# ----------------------------------------------------------------------------------------------------------
# 5. WrappedTorchNorm with sequence parallel
# ----------------------------------------------------------------------------------------------------------
def _torch_norm_sequence_parallel() -> None:
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    if getattr(cls, "_megatron_dppo_cpu", False):
        return
    original_new = cls.__new__
    _ORIGINALS["transformer.torch_norm.WrappedTorchNorm.__new__"] = original_new

    def __new__(klass, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        """Megatron's ``WrappedTorchNorm`` minus its sequence-parallel refusal: a torch norm is token-wise,
        so it is correct on a sequence shard; its weights are marked ``sequence_parallel`` so that
        ``finalize_model_grads`` sums their gradients over the TP group (as Transformer Engine's norms do)."""
        norm_classes = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if (config.normalization not in norm_classes or config.layernorm_zero_centered_gamma
                or config.persist_layer_norm or config.memory_efficient_layer_norm):
            # unsupported combinations: Megatron's own checks and messages
            return original_new(klass, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                                normalization)
        norm = norm_classes[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm

    cls.__new__ = staticmethod(__new__)
    cls._megatron_dppo_cpu = True


_PATCHES.append(_torch_norm_sequence_parallel)
# A pure relaxation, also used by model.build_layer_spec for the local spec on GPUs without Transformer Engine.
allow_sequence_parallel_torch_norm = _torch_norm_sequence_parallel


# ----------------------------------------------------------------------------------------------------------
# 6. MoE all-to-all token dispatcher without CUDA streams
# ----------------------------------------------------------------------------------------------------------
class _NoStream:
    """Stands in for the dispatcher's class-level device-to-host CUDA stream (never used on CPU)."""


def _cpu_dtoh_and_synchronize(self, point: str, tokens_per_expert=None):
    """``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` on CPU: the same conversions of the split
    sizes to host values (numpy for the all-to-all splits) at the same point, without the side stream and event
    that the CUDA version uses to overlap the copy."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        def host(t, as_numpy=False):
            return t.numpy() if as_numpy and torch.is_tensor(t) else t

        self.input_splits = host(self.input_splits, True)
        self.output_splits = host(self.output_splits, True)
        self.output_splits_tp = host(self.output_splits_tp, True)
    return tokens_per_expert


def _moe_dispatcher_without_streams() -> None:
    try:
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    except ImportError as err:  # a Megatron-Core build without MoE
        logger.debug("CPU backend: MoE token dispatcher not importable (%s); skipped", err)
        return
    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoStream()
    _ORIGINALS["MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize"] = (
        MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize)
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_dtoh_and_synchronize


_PATCHES.append(_moe_dispatcher_without_streams)


# ==========================================================================================================
# Optimizer / checkpoint redirections (owned by the "engine-train" helper). Append below with
# `register_cpu_patch` (or `_PATCHES.append`); keep each one a small named function documented like those above.
# ==========================================================================================================
