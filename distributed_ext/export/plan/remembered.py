"""What an export asks of its plan more than once, remembered for that export."""

from __future__ import annotations

import weakref
from typing import Any


class LastAnswer:
    """The last answer of a step of the plan for one model and key, which an export asks
    more than once (the model held weakly: not kept alive by this); the rounds forget it at
    the start of each export, as the model may have changed since."""

    def __init__(self) -> None:
        self._last: tuple[Any, Any, Any] | None = None

    def get(self, model: Any, key: Any) -> Any:
        """The answer given for ``model`` and ``key`` last, else None."""
        last = self._last
        if last is not None and last[0]() is model and last[1] == key:
            return last[2]
        return None

    def put(self, model: Any, key: Any, answer: Any) -> None:
        self._last = (weakref.ref(model), key, answer)

    def forget(self) -> None:
        self._last = None
