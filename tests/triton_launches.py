"""Triton kernel launches recorded in Triton's interpreter (where the CPU tests
run every kernel): each launch's configuration as Triton's JIT specializes
it, and what compiling that configuration for a GPU takes
(tests/triton_gpu_compile.py)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest
    from triton.runtime.interpreter import InterpretedFunction


class LaunchRecorder:
    """Every interpreted launch's configuration, keyed as Triton keys its
    compiles (its constexprs and, for every other argument, the type and
    whether it is 1 or a multiple of 16, or, for a pointer, 16-byte aligned),
    with the ``ASTSource`` arguments and options that compile it."""

    def __init__(self) -> None:
        self.specs: dict[tuple, dict[str, Any]] = {}

    @property
    def keys(self) -> set[tuple]:
        return set(self.specs)

    def record(self, function: InterpretedFunction, args: tuple, kwargs: dict) -> None:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl

        signature_of_fn = inspect.signature(function.fn)
        params = list(signature_of_fn.parameters.values())
        names = [p.name for p in params]

        def named(option: str) -> set[str]:
            return {names[i] if isinstance(i, int) else i
                    for i in function.kwargs.get(option) or ()}

        no_value, no_alignment = named("do_not_specialize"), named(
            "do_not_specialize_on_alignment")
        call = signature_of_fn.bind(
            *args, **{k: v for k, v in kwargs.items() if k in names})
        call.apply_defaults()
        options = {k: v for k, v in kwargs.items() if k not in names}
        key_parts, signature, constexprs, aligned = [], {}, {}, []
        for index, param in enumerate(params):
            value = call.arguments[param.name]
            if "constexpr" in str(param.annotation):
                key_parts.append((param.name, value))
                signature[param.name], constexprs[param.name] = "constexpr", value
                continue
            if param.annotation is not inspect.Parameter.empty:
                raise NotImplementedError(f"{function.fn.__name__}: the JIT types annotated "
                                          f"parameters ({param.name}); record them too")
            kind, special = native_specialize_impl(BaseBackend, value, False,
                                                   param.name not in no_value,
                                                   param.name not in no_alignment)
            key_parts.append((param.name, (kind, special)))
            if kind == "constexpr":  # an integer 1, or None
                signature[param.name], constexprs[param.name] = "constexpr", special
            else:
                signature[param.name] = kind
                if special == "D":
                    aligned.append(index)
        key = (function.fn.__name__, tuple(key_parts), tuple(sorted(options.items())))
        self.specs.setdefault(key, {
            "module": function.fn.__module__, "name": function.fn.__name__,
            "signature": signature, "constexprs": constexprs, "aligned": aligned,
            "options": options})

    def install(self, monkeypatch: pytest.MonkeyPatch, execute: bool = True) -> None:
        """Record every launch from now on; ``execute=False``: record only (a
        launch's configuration depends on the host's arguments, not on what
        earlier kernels computed)."""
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run
        recorder = self

        def run(function, *args, grid, warmup, **kwargs):
            recorder.record(function, args, kwargs)
            if execute:
                return original(function, *args, grid=grid, warmup=warmup, **kwargs)
            return None

        monkeypatch.setattr(InterpretedFunction, "run", run)
