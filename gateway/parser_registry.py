"""ParserRegistry: parser classes by name (the tool-call and the reasoning formats), filled by a class decorator."""
from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class ParserRegistry(Generic[T]):
    """Subclasses of `base` by name; `what` names them in errors ("tool-call parser")."""

    def __init__(self, what: str, base: type) -> None:
        self.what, self.base = what, base
        self.parsers: dict[str, T] = {}

    def register(self, name: str, force: bool = False) -> Callable[[T], T]:
        """A class decorator that registers a subclass of `base` as `name` (ValueError if the name is taken, unless
        `force`); the class's `name` becomes `name`."""
        def register(parser: T) -> T:
            if not (isinstance(parser, type) and issubclass(parser, self.base)):
                raise TypeError(f"{self.what} {name!r} must be a {self.base.__name__} subclass, got {parser!r}")
            if name in self.parsers and not force and self.parsers[name] is not parser:
                raise ValueError(f"a {self.what} named {name!r} is already registered")
            parser.name = name
            self.parsers[name] = parser
            return parser
        return register

    def names(self) -> list[str]:
        return sorted(self.parsers)

    def get(self, name: str) -> T:
        """The parser registered as `name`; ValueError listing the registered names otherwise."""
        if name not in self.parsers:
            raise ValueError(f"unknown {self.what} {name!r}: the registered ones are {', '.join(self.names())}")
        return self.parsers[name]
