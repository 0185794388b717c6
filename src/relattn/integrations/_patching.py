"""What every ``patch(model)`` shares: its report, swapping a module's forward in place (and back), the warning
when nothing was patched. A patched module keeps its class, parameters and ``state_dict``; only its ``forward``
(an instance attribute) and the ``_relattn_*`` attributes it reads are added."""

from __future__ import annotations

import types
import warnings
from dataclasses import dataclass, field

from torch import nn


@dataclass
class PatchReport:
    """What ``patch`` did: ``patched`` module names, and ``skipped`` attention modules with the reason (only modules
    left as they are: a wrapper whose inner attention is patched, as DeBERTa's ``attention.self``, is not listed)."""

    patched: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def warn_if_empty(self, model: nn.Module, supported) -> None:
        if not self.patched:
            warnings.warn(f"relattn.patch found no supported attention in {type(model).__name__}; supported: "
                          + ", ".join(supported), stacklevel=3)


def swap(module: nn.Module, forward, backend: str, **attributes) -> None:
    """``module.forward`` replaced by ``forward`` bound to it; ``backend`` and ``attributes`` kept as
    ``_relattn_backend`` and ``_relattn_<name>``."""
    module._relattn_backend = backend
    for name, value in attributes.items():
        setattr(module, f"_relattn_{name}", value)
    module.forward = types.MethodType(forward, module)


def patched_here(module: nn.Module) -> bool:
    return hasattr(module, "_relattn_backend") and "forward" in module.__dict__


def is_patched(model: nn.Module) -> bool:
    """Whether ``patch`` replaced the forward of ``model`` or of any module inside it."""
    return any(patched_here(m) for m in model.modules())


def unpatch(model: nn.Module) -> list[str]:
    """Undo ``patch``: every patched module gets its class's forward back. Returns the restored names."""
    restored = []
    for name, module in model.named_modules():
        if patched_here(module):
            del module.forward
            for attribute in [a for a in module.__dict__ if a.startswith("_relattn_")]:
                del module.__dict__[attribute]
            restored.append(name)
    return restored
