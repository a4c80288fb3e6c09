"""Module attributes replaced while traces run, shared by every trace of the process.

A trace replaces a few functions of other libraries (``torch.get_rng_state``, bitsandbytes'
optimizer updates) for its duration. Traces may nest or run in threads: the replacement is
installed by the first user and the originals put back by the last (:class:`SharedPatch`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

#: (module, attribute name, replacement)
Replacement = tuple[Any, str, Any]


class SharedPatch:
    """``install()`` gives the replacements (it is called by the first user, so it may read
    the originals); :meth:`release` by the last user puts the originals back."""

    def __init__(self, install: Callable[[], list[Replacement]]) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.saved: list[Replacement] = []
        self._install = install

    def acquire(self) -> None:
        """One more user: the first installs the replacements."""
        with self.lock:
            if self.users == 0:
                replacements = self._install()
                self.saved = [(module, name, getattr(module, name))
                              for module, name, _ in replacements]
                for module, name, value in replacements:
                    setattr(module, name, value)
            self.users += 1

    def release(self) -> None:
        """One user fewer: the last puts the originals back."""
        with self.lock:
            self.users -= 1
            if self.users == 0:
                for module, name, value in self.saved:
                    setattr(module, name, value)
                self.saved = []
