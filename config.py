"""Every knob of plait in one place.

Each field can be set from the environment as ``PLAIT_<NAME>`` (read once, at import) and
changed for a block of code with ``plait.config.patch(name=value)``, which also works as a
decorator. Knobs that change generated code join the compilation cache key (`cache_key`).
"""
from __future__ import annotations

import contextlib
import os

import attrs


def _env(name: str, default, convert):
    raw = os.environ.get("PLAIT_" + name.upper())
    return default if raw is None else convert(raw)


def _to_bool(raw: str) -> bool:
    return raw.strip().lower() not in ("", "0", "false", "no", "off")


@attrs.define
class Config:
    # Which backend jit uses when none is given.
    backend: str = attrs.field(factory=lambda: _env("backend", "eager", str))
    # Run the simplify passes (DCE, CSE, constant folding) before a backend sees a graph.
    simplify: bool = attrs.field(factory=lambda: _env("simplify", True, _to_bool))
    # Constant folding evaluates nodes whose result has at most this many elements.
    fold_max_numel: int = attrs.field(factory=lambda: _env("fold_max_numel", 4096, int))
    # ATen ops with no decomposition run as opaque nodes that call torch; False raises instead.
    allow_opaque: bool = attrs.field(factory=lambda: _env("allow_opaque", True, _to_bool))
    # Record the user's source line of every traced op (costs a stack walk per op).
    provenance: bool = attrs.field(factory=lambda: _env("provenance", True, _to_bool))
    # Compiled signatures kept per jitted function before the oldest is evicted.
    cache_size: int = attrs.field(factory=lambda: _env("cache_size", 64, int))

    def cache_key(self) -> tuple:
        """The knobs that change what a compiled function computes or how."""
        return (self.simplify, self.fold_max_numel, self.allow_opaque)

    @contextlib.contextmanager
    def _patched(self, changes: dict):
        unknown = set(changes) - {f.name for f in attrs.fields(Config)}
        if unknown:
            from .errors import PlaitError

            raise PlaitError(f"unknown config option(s) {sorted(unknown)}; "
                             f"known: {[f.name for f in attrs.fields(Config)]}")
        saved = {name: getattr(self, name) for name in changes}
        for name, value in changes.items():
            setattr(self, name, value)
        try:
            yield self
        finally:
            for name, value in saved.items():
                setattr(self, name, value)

    def patch(self, **changes):
        """Context manager (and decorator) that sets knobs and restores them on exit."""
        return _Patch(self, changes)


class _Patch(contextlib.ContextDecorator):
    def __init__(self, config: Config, changes: dict):
        self._config, self._changes, self._stack = config, changes, []

    def __enter__(self):
        cm = self._config._patched(self._changes)
        self._stack.append(cm)
        return cm.__enter__()

    def __exit__(self, *exc):
        return self._stack.pop().__exit__(*exc)


config = Config()
