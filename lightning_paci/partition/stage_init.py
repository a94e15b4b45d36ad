"""Build only a stage's parameters: the model on the meta device, then each stage's own share, initialized as an
ordinary build of the same code would initialize it.

[Note: stage-only construction]
Pipeline parallelism is for models too big for one device, so no rank may hold more than its stage. A model built
in ``LightningModule.configure_model()`` is built twice, both times by the user's own code:

1. **Recording** (inside Lightning's ``configure_model`` call): every parameter becomes a meta tensor as it is
   registered (``register_module_parameter_registration_hook``); buffers stay real, so causal masks and rotary
   tables keep their values. The meta model is enough to plan the partition. Random number generators are put
   back afterwards, so this build consumes no draws.
2. **Replay** (right after, before Lightning goes on): the module's attributes are put back as they were before
   the hook and ``configure_model`` runs again. The ``k``-th parameter registration is the ``k``-th of the
   recording (same code; checked by shape), so it is known to belong to this stage or not: the stage's own are kept
   real on the device, the others become meta again. Every in-place operation on a meta tensor (``uniform_``,
   ``normal_``, ``nn.init.kaiming_uniform_`` ... seen by a ``TorchFunctionMode``) is run on a scratch tensor of
   the same shape, dtype and device and thrown away, so the random draws are exactly an ordinary build's: the
   stage's parameters are bit for bit those of ``Trainer(devices=1)`` and the generators end where an ordinary
   build leaves them (data order, dropout streams unchanged). ``nn.init.trunc_normal_``, ``orthogonal_``,
   ``sparse_`` and ``dirac_`` return early on meta tensors in Python, before any operation a mode could see; they
   are wrapped for the duration (called through ``torch.nn.init``; a copy imported by name elsewhere is not).

The replay costs one full model's worth of random draws per rank, one tensor in memory at a time. With
``PACIStrategy(weights=...)`` there is no replay: every parameter comes from the file (weights.py).
"""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.overrides import TorchFunctionMode

from lightning_paci.errors import BuildMismatchError, MetaLoadError

__all__ = ["BuildMismatchError", "MetaLoadError", "Recording", "generator_states", "meta_load_guard",
           "owned_registrations", "replay", "rewind_point"]

_META_SKIPPING = ("orthogonal_", "sparse_", "dirac_", "_no_grad_trunc_normal_")  # early return on meta, torch 2.13
_NO_OP_LOAD = r".*copying from a non-meta parameter in the checkpoint to a meta parameter.*"


class Recording:
    """Pass 1: parameters become meta as they are registered (``active()`` decides when), in registration order."""

    def __init__(self, active: Callable[[], bool]) -> None:
        self.active = active
        self.params: list[nn.Parameter] = []  # every registration's Parameter, in order (a tie appears twice)

    def _hook(self, module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or not self.active():
            return None
        if not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        self.params.append(param)
        return param

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        # torch types the hook as returning None; the documented hook may return a replacement Parameter
        handle = register_module_parameter_registration_hook(self._hook)  # type: ignore[arg-type]
        try:
            yield
        finally:
            handle.remove()


def owned_registrations(recorded: Sequence[nn.Parameter], root: nn.Module, owned: Callable[[str], bool]) -> set[int]:
    """The registration numbers whose Parameter is (under any of its names in ``root``) one of the stage's."""
    keep = {id(p) for name, p in root.named_parameters(remove_duplicate=False) if owned(name)}
    return {k for k, p in enumerate(recorded) if id(p) in keep}


class _Scratch:
    """One reused buffer per dtype for the thrown-away tensors: a fresh allocation per parameter would leave the
    allocator holding (and the process's resident memory counting) every one of them; a view of one buffer keeps
    the replay at the largest parameter. Draws depend on the shape and strides, not on the memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def like(self, tensor: torch.Tensor) -> torch.Tensor:
        span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) \
            if tensor.numel() else 0
        buffer = self._buffers.get(tensor.dtype)
        if buffer is None or buffer.numel() < span:
            self._buffers.pop(tensor.dtype, None)  # free the smaller one first
            buffer = self._buffers[tensor.dtype] = torch.empty(max(span, 1), dtype=tensor.dtype, device=self.device)
        return buffer.as_strided(tensor.shape, tensor.stride())


class _ScratchMode(TorchFunctionMode):
    """Run every in-place operation on a meta tensor on a thrown-away real tensor (its random draws happen)."""

    def __init__(self, scratch: _Scratch) -> None:
        super().__init__()
        self.scratch = scratch

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        # nn.init's functions hand the tensor on as a keyword too (``handle_torch_function(..., tensor=tensor)``)
        target = args[0] if args else kwargs.get("tensor")
        if not (isinstance(target, torch.Tensor) and target.is_meta and name.endswith("_")
                and not name.startswith("__")):
            return func(*args, **kwargs)
        scratch = self.scratch.like(target)
        args = tuple(scratch if a is target else a for a in args)
        kwargs = {k: scratch if v is target else v for k, v in kwargs.items()}
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in (*args, *kwargs.values())):
            return target  # e.g. a copy from another meta tensor: no draw to make
        func(*args, **kwargs)
        return target


@contextlib.contextmanager
def _meta_skipping_inits(scratch: _Scratch) -> Iterator[None]:
    """Wrap the initializers that return early on meta tensors so that their draws happen on a scratch tensor."""
    originals = {name: getattr(nn.init, name) for name in _META_SKIPPING if hasattr(nn.init, name)}

    def wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
        def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                original(scratch.like(tensor), *args, **kwargs)
                return tensor
            return original(tensor, *args, **kwargs)
        return init

    for name, original in originals.items():
        setattr(nn.init, name, wrapped(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(nn.init, name, original)


@contextlib.contextmanager
def replay(recorded: Sequence[nn.Parameter], keep: set[int], device: torch.device) -> Iterator[None]:
    """Pass 2: registrations numbered in ``keep`` stay real, the others become meta; draws on meta tensors happen on
    scratch tensors. Raises :class:`BuildMismatchError` when the build registers other parameters than
    ``recorded``."""
    count = 0

    def hook(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        nonlocal count
        if param is None:
            return None
        k, count = count, count + 1
        if k >= len(recorded) or recorded[k].shape != param.shape:
            raise BuildMismatchError(
                f"the second `configure_model` call registered {type(module).__name__}.{name} with shape "
                f"{tuple(param.shape)} as parameter #{k}, the first call "
                f"{'registered ' + str(tuple(recorded[k].shape)) if k < len(recorded) else 'had no such parameter'}. "
                f"Stage-only construction runs `configure_model` twice; make it build the same model each time "
                f"(no randomness in the architecture), or pass `PACIStrategy(model_init='full')`.")
        if param.is_meta or k in keep:
            return None
        return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    # torch types the hook as returning None; the documented hook may return a replacement Parameter
    handle = register_module_parameter_registration_hook(hook)  # type: ignore[arg-type]
    try:
        scratch = _Scratch(device)
        with _meta_skipping_inits(scratch), _ScratchMode(scratch):
            yield
    finally:
        handle.remove()
    if count != len(recorded):
        raise BuildMismatchError(f"the second `configure_model` call registered {count} parameters, the first "
                                 f"{len(recorded)}; make `configure_model` build the same model each time.")


@contextlib.contextmanager
def meta_load_guard(fix: str) -> Iterator[None]:
    """``load_state_dict`` into a meta parameter is an error (``fix`` says the supported way), not torch's no-op;
    so is one from a model built inside the same hook (its parameters are meta too: nothing to copy)."""
    message = ("`load_state_dict` inside `configure_model` loads into meta parameters (the model is built on the "
               f"meta device, one stage materialized per rank), which would leave the weights random. {fix}")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=_NO_OP_LOAD, category=UserWarning)
        try:
            yield
        except UserWarning as err:
            if "to a meta parameter" not in str(err):
                raise
            raise MetaLoadError(message) from err
        except RuntimeError as err:
            if "loading state_dict" not in str(err) or "meta tensor" not in str(err):
                raise
            raise MetaLoadError(message) from err


def generator_states() -> Callable[[], None]:
    """Snapshot the random generators (torch CPU and CUDA, Python, NumPy); the returned call puts them back."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    py = random.getstate()
    numpy_random: Any = None
    try:
        import numpy

        numpy_random = numpy.random
        np_state: Any = numpy_random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        np_state = None

    def restore() -> None:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(py)
        if numpy_random is not None:
            numpy_random.set_state(np_state)
    return restore


def rewind_point(module: nn.Module) -> Callable[[], None]:
    """Snapshot ``module``'s own attributes (not its children's); the returned call puts them back, so that an
    idempotent ``configure_model`` (``if self.model is not None: return``) builds again."""
    saved = {key: (dict(value) if key in ("_modules", "_parameters", "_buffers") else value)
             for key, value in module.__dict__.items()}

    def rewind() -> None:
        for key in [k for k in module.__dict__ if k not in saved]:
            del module.__dict__[key]
        for key, value in saved.items():
            if key in ("_modules", "_parameters", "_buffers"):
                module.__dict__[key].clear()
                module.__dict__[key].update(value)
            else:
                module.__dict__[key] = value
    return rewind
