"""The engine argument `logits_processors`: its names and classes, resolved once where the
engine starts (a wrong one fails the start, not a worker), then sent to the worker that
samples.

A name ("package.module:Class", vLLM's spelling, or "package.module.Class") is imported
again by that worker, which must be able to import it (the server flag's case). A class
object (`LLM(logits_processors=[MyProcessor])`) travels by value, pickled with its module's
code: a Ray worker may run where the class's module is not importable (a test file, a
notebook, `__main__`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from raylm.engine.logits_processor import LogitsProcessor

_ALLOWED = ("a LogitsProcessor subclass (raylm.engine.logits_processor), or its name as 'package.module:Class' "
            "or 'package.module.Class'")


@dataclass(frozen=True, eq=False)
class LogitsProcessorClass:
    """One entry of `logits_processors`, resolved to its class."""

    name: str  # as given, or the class's module and qualified name
    cls: type[LogitsProcessor]
    # Given by name: workers import the name; else the class is pickled by value.
    by_name: bool

    def __reduce__(self):
        if self.by_name:
            return logits_processor_class, (self.name,)
        return _class_from_pickle, (self.name, _pickled_by_value(self.cls))


def resolve_logits_processors(specs: Sequence[str | type] | None) -> tuple[LogitsProcessorClass, ...]:
    """The classes of the `logits_processors` engine argument; ValueError naming the entry
    that is not a LogitsProcessor subclass or an importable name of one."""
    if specs is None:
        return ()
    if isinstance(specs, (str, type)):
        raise ValueError(f"logits_processors takes a list of {_ALLOWED}; got one {type(specs).__name__}, "
                         f"{specs!r}: put it in a list.")
    resolved = []
    for spec in specs:
        if isinstance(spec, LogitsProcessorClass):
            resolved.append(spec)
        elif isinstance(spec, str):
            resolved.append(logits_processor_class(spec))
        elif isinstance(spec, type):
            _check_subclass(spec, f"{spec.__module__}.{spec.__qualname__}")
            resolved.append(LogitsProcessorClass(f"{spec.__module__}.{spec.__qualname__}", spec, by_name=False))
        else:
            raise ValueError(f"logits_processors entries must each be {_ALLOWED}; got {spec!r}.")
    return tuple(resolved)


def logits_processor_class(name: str) -> LogitsProcessorClass:
    """The class a qualified name names, imported here."""
    module_name, attribute_path = _split(name)
    try:
        found = importlib.import_module(module_name)
        for attribute in attribute_path.split("."):
            found = getattr(found, attribute)
    except Exception as error:  # an import error, or any error the module raises as it loads
        raise ValueError(f"logits_processors entry {name!r} cannot be imported ({type(error).__name__}: {error}); "
                         f"it must be {_ALLOWED} that this process (and the worker that samples) can "
                         f"import.") from error
    if not isinstance(found, type):
        raise ValueError(f"logits_processors entry {name!r} is a {type(found).__name__}, not a class; it must be "
                         f"{_ALLOWED}.")
    _check_subclass(found, name)
    return LogitsProcessorClass(name, found, by_name=True)


def _split(name: str) -> tuple[str, str]:
    if ":" in name:
        module_name, _, attribute_path = name.partition(":")
    else:
        module_name, _, attribute_path = name.rpartition(".")
    if not module_name or not attribute_path:
        raise ValueError(f"logits_processors entry {name!r} names no module and class; it must be {_ALLOWED}.")
    return module_name, attribute_path


def _check_subclass(cls: type, name: str) -> None:
    if not issubclass(cls, LogitsProcessor):
        raise ValueError(f"logits_processors entry {name!r} is not a subclass of "
                         f"raylm.engine.logits_processor.LogitsProcessor (a vLLM processor ports by importing "
                         f"LogitsProcessor, BatchUpdate and MoveDirectionality from there).")


def _pickled_by_value(cls: type) -> bytes:
    """The class pickled with its code (and its module's functions and classes it uses),
    so that unpickling needs only raylm and what the module itself imports."""
    from ray import cloudpickle  # Ray's copy: Ray workers are where a class travels to

    module = sys.modules.get(cls.__module__)
    if module is None or cls.__module__ == "__main__" or module.__name__ in cloudpickle.list_registry_pickle_by_value():
        return cloudpickle.dumps(cls)  # by value already (`__main__`), or as registered
    cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(cls)
    finally:
        cloudpickle.unregister_pickle_by_value(module)


def _class_from_pickle(name: str, pickled: bytes) -> LogitsProcessorClass:
    from ray import cloudpickle

    return LogitsProcessorClass(name, cloudpickle.loads(pickled), by_name=False)
