"""The one way this package recognizes a DTensor, without importing torch's DTensor module.

Whoever made a DTensor imported ``torch.distributed.tensor``; importing it here would add
~1 s to ``import distributed_ext``, so the class is looked up where it is already loaded.
"""

from __future__ import annotations

import sys
from typing import Any

_DTENSOR: type | None = None


def dtensor_type() -> type | None:
    """torch's DTensor class if its module is loaded (a state with DTensors has loaded it)."""
    global _DTENSOR
    if _DTENSOR is None:
        module = sys.modules.get("torch.distributed.tensor")
        _DTENSOR = getattr(module, "DTensor", None)
    return _DTENSOR


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (False while no DTensor can exist)."""
    dtensor = dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)
