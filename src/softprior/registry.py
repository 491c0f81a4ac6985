"""One small generic registry: a name -> entry table with registration, lookup, a one-line error
naming the unknown name and the allowed ones, and a listing. Paths, tasks, model presets, positional
schemes and experiments each keep one (a read-only ``Mapping``, so ``name in R`` and ``R[name]``
work as for a dict)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Mapping, Generic[T]):
    def __init__(self, kind: str, error: type[Exception] = KeyError, entries: Mapping[str, T] | None = None,
                 describe: Callable[[T], str] = lambda entry: "", hint: str = ""):
        self.kind, self.error, self.describe, self.hint = kind, error, describe, hint
        self._entries: dict[str, T] = dict(entries or {})

    def register(self, name: str, entry: T, *, overwrite: bool = False) -> T:
        if name in self._entries and not overwrite:
            raise ValueError(f"{self.kind} {name!r} is already registered (pass overwrite=True)")
        self._entries[name] = entry
        return entry

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise self.error(f"unknown {self.kind} {name!r}; allowed: {', '.join(self._entries)}"
                             + (f", {self.hint}" if self.hint else "")) from None

    def __contains__(self, name) -> bool:  # Mapping's would call __getitem__, which raises self.error
        return name in self._entries

    def get(self, name: str, default=None):  # Mapping.get, without the error
        return self._entries.get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def listing(self) -> list[tuple[str, str]]:
        """(name, one-line description) per entry, in registration order."""
        return [(k, self.describe(v)) for k, v in self._entries.items()]
