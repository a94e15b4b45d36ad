"""Placeholders for the modules another stage owns, and the per-forward state they share with a stage's hooks.

On stage ``s`` every module another stage owns is replaced by a parameter-free ``Placeholder`` (carve.py). It
returns zeros of the real module's output *form* -- found by running the module on the meta device, or on fake
tensors under autocast -- so that the user's code between modules (mask construction, dtype checks) runs; the
values it returns are replaced at the stage's ingress, or by the real ones where they are relayed
([Note: relayed crossings] in relay.py). ``BoundaryState`` is what one forward's placeholders and boundary hooks
share: the received inputs, the values relayed in and out, the calls counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_paci.engine.transport.messages import flatten, map_tensors, unflatten
from lightning_paci.errors import CrossingError

__all__ = ["BoundaryState", "CrossingError", "Placeholder", "StageDone"]


class StageDone(BaseException):
    """Raised by the egress hook to end a non-last stage's forward inside the user's code.

    A ``BaseException`` so that a user's ``except Exception`` cannot swallow it.
    """


class Placeholder(nn.Module):
    """Parameter-free stand-in for a module another stage owns.

    It must return what the real module would return in *form* (structure, shapes, dtypes), or the user's code
    between it and this stage's first block may fail (an embedding's output dtype feeds mask construction, a block
    may return a tuple). It runs the original module on the meta device (on fake tensors under autocast) -- no
    compute, no memory -- and returns zeros of that form, or the real values relayed to it. A block whose output
    has the form of its first argument, or cannot be run on meta, passes its input through (its value is replaced
    at this stage's ingress anyway).
    """

    def __init__(self, owner: str, shadow: nn.Module, *, may_pass_through: bool = False, name: str = "",
                 boundary: BoundaryState | None = None, device: torch.device | None = None) -> None:
        super().__init__()
        self.owner = owner
        # kept outside nn.Module registration: the shadow's meta parameters must not appear in state_dict()
        self.__dict__["_shadow"] = shadow
        self.__dict__["_boundary"] = boundary
        # where its zeros are made: the stage's device, followed through `.to(...)` (an input may be on meta: code
        # such as `ids.to(self.embed_tokens.weight.device)` reads the placeholder's meta weight)
        self.__dict__["_device"] = device
        self._name = name
        self._may_pass_through = may_pass_through
        self._pass_through = False
        # [Note: output forms kept]: the last inputs' form and the output form found for it
        self.__dict__["_form"] = None

    def stands_for(self) -> tuple[str, nn.Module]:
        """The module path this placeholder stands for in the whole model, and the real module's copy on the meta
        device (structure and parameter shapes, no values). A method with a name no model uses: an attribute read
        the placeholder does not define goes to that copy ([Note: placeholders answer attribute reads])."""
        return self._name, self.__dict__["_shadow"]

    def __getattr__(self, attribute: str) -> Any:
        """[Note: placeholders answer attribute reads]
        Code outside a module reads its attributes: torch's ``TransformerDecoder.forward`` reads
        ``self.layers[0].self_attn.batch_first`` on every stage, transformers reads ``config`` of submodules. A
        placeholder answers with the real module's structure, kept on the meta device (its submodules, flags and
        parameter shapes; no values). Code that computes with such a parameter is stopped at setup by the probe
        (crossing.py), naming the parameter and its stage."""
        try:
            return super().__getattr__(attribute)
        except AttributeError:
            shadow = self.__dict__.get("_shadow")
            if shadow is None or attribute.startswith("__"):
                raise
            return getattr(shadow, attribute)

    def __getitem__(self, index: Any) -> Any:
        raise CrossingError(
            f"`{self._name}` ({type(self.__dict__['_shadow']).__name__}) lives on {self.owner}, and code on another "
            f"stage indexes it (`[{index!r}]`): a container indexed inside the loop over the blocks (one list per "
            f"kind of sub-layer, as XLM's `attentions[i]`, `ffns[i]`) runs on every stage, but only one container "
            f"is cut with it. Hold each layer's parts in one block module (the usual layout), or train on one "
            f"device.")

    def _apply(self, fn: Any, recurse: bool = True) -> Placeholder:
        """``module.to(torch.float64)`` / ``.half()`` / ``.to(device)`` reach the placeholder, not the shadow it
        keeps unregistered: apply the dtype part to the shadow (it stays on meta), so that the zeros it shapes have
        the dtype the real module would have under ``precision="64-true"`` or ``"bf16-true"``."""
        shadow, device = self.__dict__["_shadow"], self.__dict__["_device"]

        def dtype_only(tensor: torch.Tensor) -> torch.Tensor:
            probe = fn(torch.empty(0, dtype=tensor.dtype, device=device))  # what fn does, away from meta
            return tensor if probe.dtype == tensor.dtype else tensor.to(probe.dtype)

        shadow._apply(dtype_only)
        self.__dict__["_device"] = fn(torch.empty(0, device=device)).device
        self.__dict__["_form"] = None  # the output form may change with the dtype
        return super()._apply(fn, recurse)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else next(iter(kwargs.values()), None)
        boundary = self.__dict__["_boundary"]
        relayed: dict[int, torch.Tensor] = {}
        if boundary is not None:  # count this call; take the real values relayed to it (partition/relay.py)
            call = boundary.calls.get(self._name, 0)
            boundary.calls[self._name] = call + 1
            prefix = f"{self._name}#{call}#"
            relayed = {int(k[len(prefix):]): v for k, v in boundary.relay_in.items() if k.startswith(prefix)}
        if self._pass_through and not relayed and isinstance(first, torch.Tensor):
            return first.view_as(first)  # a new tensor: the probe tells a block's output from its input
        shadow, device = self.__dict__["_shadow"], self.__dict__["_device"]
        key = _form_key(shadow, args, kwargs, device) if boundary is None or not boundary.probing else None
        key = None if key is None else (self.training, key)
        kept = self.__dict__["_form"]
        try:
            if kept is not None and key is not None and kept[0] == key:
                out = kept[1]
            else:
                if boundary is not None:
                    boundary.in_shadow += 1
                try:
                    with torch.no_grad():
                        out = _output_form(shadow, args, kwargs, device)
                finally:
                    if boundary is not None:
                        boundary.in_shadow -= 1
                self.__dict__["_form"] = None if key is None else (key, out)
        except Exception as err:  # e.g. an op without a meta kernel: the output form is unknown
            if self._may_pass_through and isinstance(first, torch.Tensor):
                # a block whose output cannot be found on meta (a mixture of experts routes with torch.nonzero,
                # data-dependent): pass its input on, as a block of the usual form does -- the values before this
                # stage's first block are replaced at its ingress, and the probe stops any that are read
                self._pass_through = True
                return first.view_as(first)
            raise RuntimeError(
                f"Could not infer the output form of {type(shadow).__name__} (owned by {self.owner}) on the meta "
                f"device: {err}. Move the code that uses its output into a module on the same stage, or place the "
                f"module explicitly with `partition=`."
            ) from err
        if relayed:
            skeleton, metas = flatten(out)
            return unflatten(skeleton, [relayed.get(i, torch.zeros(t.shape, dtype=t.dtype, device=device))
                                        for i, t in enumerate(metas)])
        if self._may_pass_through and isinstance(out, torch.Tensor) and isinstance(first, torch.Tensor) and (
            out.shape == first.shape and out.dtype == first.dtype
        ):
            self._pass_through = True
            return first.view_as(first)
        return map_tensors(out, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device))

    def extra_repr(self) -> str:
        return f"lives on {self.owner}"


# [Note: output forms kept]
# Running a module on the meta device goes through torch's Python decompositions: about a thousand Python calls per
# placeholder and micro-batch, the largest host cost of a stage's forward. The output form depends on the inputs'
# forms (structure, shapes, dtypes, devices), on plain values among the inputs, on the module's mode and dtypes and
# on autocast, so a placeholder keeps the last inputs' form with the output form it found, and reuses it while those
# stay the same: a steady run finds each form once. Inputs holding anything but tensors and plain immutable values
# (a cache object, a list of modules) are never matched: their state could change the form unseen.
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _form_key(shadow: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device) -> Any:
    """What the output form of ``shadow`` depends on, as a hashable value; None where it cannot be told."""
    parts: list[Any] = [shadow.training, torch.is_autocast_enabled(device.type)]
    if parts[-1]:
        parts.append(torch.get_autocast_dtype(device.type))

    def walk(node: Any) -> bool:
        if isinstance(node, torch.Tensor):
            parts.append((tuple(node.shape), node.dtype, node.device.type))
        elif isinstance(node, _PLAIN):
            parts.append(node)
        elif isinstance(node, (tuple, list)):
            parts.append((type(node), len(node)))
            return all(walk(v) for v in node)
        elif type(node) is dict:
            parts.append((dict, tuple(node)))
            return all(isinstance(k, str) for k in node) and all(walk(v) for v in node.values())
        else:
            return False
        return True

    return tuple(parts) if walk(args) and walk(kwargs) else None


def _to_meta(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("meta")


def _output_form(shadow: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device) -> Any:
    """What ``shadow`` returns for these inputs, in form only. On the meta device, except under autocast: autocast
    keys on the tensors' device, so there the module runs on fake tensors of the stage's device (no memory, no
    compute, about 1 ms a call), and an output it would make in bfloat16 (a Linear's) is bfloat16 here too, as on
    one device."""
    if device.type == "meta" or not torch.is_autocast_enabled(device.type):
        return shadow(*map_tensors(args, _to_meta), **map_tensors(kwargs, _to_meta))
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    with FakeTensorMode(allow_non_fake_inputs=True):
        state = {name: torch.empty(t.shape, dtype=t.dtype, device=device) for name, t in
                 [*shadow.named_parameters(remove_duplicate=False), *shadow.named_buffers(remove_duplicate=False)]}
        fake_args, fake_kwargs = map_tensors((args, kwargs), lambda t: torch.empty(t.shape, dtype=t.dtype,
                                                                                   device=device))
        return functional_call(shadow, state, tuple(fake_args), dict(fake_kwargs))


@dataclass
class BoundaryState:
    """Per-forward state the hooks share with the runtime."""

    incoming: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # (args, kwargs) for the first local block
    outgoing: tuple[Any, ...] | None = None  # captured (args, kwargs[, relayed]) for the next stage
    # values relayed past stage boundaries (partition/relay.py), keyed "module#call#leaf": received / to send
    relay_in: dict[str, torch.Tensor] = field(default_factory=dict)
    relay_out: dict[str, torch.Tensor] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)  # calls of each placeholder / relayed module this forward
    sends: tuple[str, ...] = ()  # the relayed keys this stage sends (made here or passed on), in message order
    versions: dict[str, int] = field(default_factory=dict)  # tensor versions of relay_out at capture
    probing: bool = False  # a setup probe: the first local block keeps fresh zeros of its own inputs
    in_shadow: int = 0  # > 0 while a placeholder runs its module on the meta device
    grad_at_begin: bool = False  # whether the forward began with gradients on (the egress checks it still is)
    # "module#call" of the values this stage makes after its egress ([Note: late relays] in relay.py)
    late: frozenset[str] = frozenset()
    held: tuple[Any, ...] | None = None  # the next stage's block inputs, captured at the egress

    def begin(self, received: Any) -> None:
        """Start a forward with ``received`` (the previous stage's message, None on stage 0)."""
        self.grad_at_begin = torch.is_grad_enabled()
        self.calls.clear()
        self.relay_out = {}
        self.outgoing = None
        self.held = None
        if received is not None and len(received) == 3:
            self.incoming, self.relay_in = (received[0], received[1]), received[2]
        else:
            self.incoming, self.relay_in = received, {}

    def end(self) -> None:
        self.incoming, self.relay_in, self.relay_out, self.held = None, {}, {}, None

    @property
    def past_egress(self) -> bool:
        return self.held is not None

    def late_made(self) -> bool:
        """Whether every value this stage makes after its egress is made."""
        return all(any(k.startswith(f"{key}#") for k in self.relay_out) for key in self.late)

    def finish(self, stage: int) -> None:
        """End the stage's forward: the message for the next stage is what the egress held, and the relayed
        values; raises ``StageDone``."""
        assert self.held is not None
        args, kwargs = self.held
        self.outgoing = (args, kwargs, self.relayed(stage)) if self.sends else (args, kwargs)
        raise StageDone

    def relayed(self, stage: int) -> dict[str, torch.Tensor]:
        """What this stage relays onward (``sends``, in that order): made here, or received and passed on."""
        out: dict[str, torch.Tensor] = {}
        for key in self.sends:
            value = self.relay_out.get(key, self.relay_in.get(key))
            if value is None:
                module, call, _ = key.split("#")
                raise CrossingError(
                    f"Stage {stage} must relay call {call} of `{module}` to a later stage that reads it, but that "
                    f"call did not run here before the stage's end: a module called again after its stage ended "
                    f"(one module used at two places of the model) cannot be relayed. Give each place its own "
                    f"module, or keep both places on one stage with `partition=`.")
            if key in self.relay_out and value._version != self.versions[key]:
                raise CrossingError(
                    f"Stage {stage}: the output of `{key.split('#')[0]}` that a later stage reads was modified in "
                    f"place after it was made; the later stage would read another value than this one's code. "
                    f"Make the in-place operation out of place (e.g. `x = x + y` instead of `x += y`).")
            out[key] = value
        return out


