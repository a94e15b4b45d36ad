"""Pretrained weights read per stage (``PACIStrategy(weights=PATH)``): a stage opens only the files that hold its
keys and reads only its keys, memory-mapped, one tensor at a time.

PATH is one of

* a transformers directory: ``model.safetensors``, or several safetensors files with their
  ``model.safetensors.index.json`` (its ``weight_map`` says which file holds which key, so a stage opens only its
  files; without an index every file's header is read to find the keys);
* one ``.safetensors`` file;
* a Lightning/PACI consolidated checkpoint (``.ckpt``/``.pt``: ``torch.load(mmap=True, weights_only=True)``, its
  ``state_dict``);
* a PACI sharded checkpoint directory (``meta.pt`` + ``stage_NNN.pt``, each memory-mapped, ``weights_only=True``).

Names: the file's keys are the LightningModule's ``state_dict()`` names, or those names less one common prefix
(the attribute that holds a transformers model: ``model.``), detected from the keys and logged. A tied weight the
file stores under one name only (GPT-2 keeps ``transformer.wte.weight``, not ``lm_head.weight``) is read from that
name. A parameter the file lacks, or a file key no parameter or buffer takes, is an error listing them; a
persistent buffer the file lacks keeps the value the model's own code gave it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_paci.errors import WeightsError

__all__ = ["WeightsError", "WeightsFile", "match_names"]

_INDEX = "model.safetensors.index.json"


@dataclass
class WeightsFile:
    """The keys of a weights PATH and where each lives; tensors are read on demand (``read``), files opened lazily.

    ``opened`` records every file a tensor or a header was read from, ``read_keys`` every key read (in order): what
    a stage touched.
    """

    path: Path
    where: dict[str, str]  # key -> the file that holds it (relative to ``path`` for directories)
    kind: str
    opened: list[str] = field(default_factory=list)
    read_keys: list[str] = field(default_factory=list)
    _handles: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> WeightsFile:
        root = Path(path)
        if root.is_dir() and (root / _INDEX).is_file():
            weight_map = json.loads((root / _INDEX).read_text())["weight_map"]
            return cls(root, dict(weight_map), "safetensors (sharded, indexed)")
        if root.is_dir() and (root / "meta.pt").is_file():
            shards = sorted(p.name for p in root.glob("stage_*.pt"))
            source = cls(root, {}, "PACI sharded checkpoint")
            for name in shards:
                for key in source._torch_file(name):
                    source.where.setdefault(key, name)
            return source
        if root.is_dir():
            files = sorted(p.name for p in root.glob("*.safetensors"))
            if not files:
                raise WeightsError(f"`weights={str(path)!r}`: the directory holds no `*.safetensors` file, no "
                                   f"`{_INDEX}` and no PACI sharded checkpoint (`meta.pt`).")
            source = cls(root, {}, "safetensors (no index: every header read)")
            for name in files:
                for key in source._safetensors(name).keys():
                    source.where[key] = name
            return source
        if not root.is_file():
            raise WeightsError(f"`weights={str(path)!r}` does not exist. Pass a transformers directory, a "
                               f"`.safetensors` file, a `.ckpt` file or a PACI sharded checkpoint directory.")
        if root.suffix == ".safetensors":
            source = cls(root.parent, {}, "safetensors")
            source.where = dict.fromkeys(source._safetensors(root.name).keys(), root.name)
            return source
        source = cls(root.parent, {}, "torch checkpoint")
        source.where = dict.fromkeys(source._torch_file(root.name), root.name)
        return source

    def keys(self) -> set[str]:
        return set(self.where)

    def read(self, key: str) -> torch.Tensor:
        """One tensor, on the CPU (memory-mapped where the format allows)."""
        name = self.where[key]
        self.read_keys.append(key)
        if name.endswith(".safetensors"):
            return self._safetensors(name).get_tensor(key)
        return self._torch_file(name)[key]

    def close(self) -> None:
        self._handles.clear()

    def _safetensors(self, name: str) -> Any:
        if name not in self._handles:
            from safetensors import safe_open

            self._handles[name] = safe_open(str(self.path / name), framework="pt", device="cpu")
            self.opened.append(name)
        return self._handles[name]

    def _torch_file(self, name: str) -> Mapping[str, torch.Tensor]:
        if name not in self._handles:
            loaded = torch.load(self.path / name, map_location="cpu", mmap=True, weights_only=True)
            state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else None
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise WeightsError(f"`weights=`: {self.path / name} holds no state dict of tensors (a `state_dict` "
                                   f"entry or a dict of tensors).")
            self._handles[name] = state
            self.opened.append(name)
        return self._handles[name]


def match_names(module_names: Sequence[str], aliases: Mapping[str, Sequence[str]], buffers: Iterable[str],
                file_keys: set[str], *, path: str) -> tuple[str, dict[str, str]]:
    """Map each module name to the file key that fills it; return the common prefix the file's keys lack.

    ``aliases[name]``: the other names of the same tensor (a tied weight); ``buffers``: names the file may omit.
    Raises :class:`WeightsError` listing missing parameters and unexpected keys.
    """
    buffers = set(buffers)
    candidates = [""] + sorted({n[:i + 1] for n in module_names for i, c in enumerate(n) if c == "."}, key=len)

    def hits(prefix: str) -> int:
        return sum(1 for n in module_names if n.startswith(prefix) and n[len(prefix):] in file_keys)

    prefix = max(candidates, key=lambda p: (hits(p), -len(p)))
    mapping: dict[str, str] = {}
    for name in module_names:
        for option in (name, *aliases.get(name, ())):
            if option.startswith(prefix) and option[len(prefix):] in file_keys:
                mapping[name] = option[len(prefix):]
                break
    missing = [n for n in module_names if n not in mapping and n not in buffers]
    taken = set(mapping.values())
    every_name = set(module_names) | {a for names in aliases.values() for a in names}
    unexpected = sorted(k for k in file_keys if k not in taken and prefix + k not in every_name)
    if missing or unexpected:
        shown = (f"missing (the module has them, the file does not): {_few(missing)}" if missing else "") + \
                ("; " if missing and unexpected else "") + \
                (f"unexpected (the file has them, the module does not): {_few(unexpected)}" if unexpected else "")
        raise WeightsError(
            f"`weights={path!r}` does not match the model's names with prefix {prefix!r}: {shown}. The file's keys "
            f"must be the LightningModule's `state_dict()` names, or those less one common prefix (e.g. `model.`); "
            f"a file for another model, or a module with other attribute names, cannot be loaded.")
    return prefix, mapping


def _few(names: Sequence[str], limit: int = 8) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
