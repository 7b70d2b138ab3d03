"""Which run-config fields code reads: every pydantic field access on a config section, by dotted name.

While a `ConfigReads` is entered, reading `cfg.training.learning_rate` records "training.learning_rate"; reading a
field that holds sections (`cfg.training`, `cfg.runtime.engines`) records nothing until a plain value below it is
read. Copies made with `model_copy` record too (sections are known by class, not by instance), so a section held
in a dict is known without its key: `cfg.runtime.engines["vllm"].port` records "runtime.engines.*.port", which a
declared "runtime.engines.vllm.port" (or "runtime.engines") covers.
"""

from __future__ import annotations

import typing
from typing import Any, Iterator

from pydantic import BaseModel

from contract.config import RunConfig


def model_classes_in(annotation: Any) -> Iterator[type[BaseModel]]:
    """The pydantic classes a field annotation holds (directly, or inside Optional/list/dict)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    for argument in typing.get_args(annotation):
        yield from model_classes_in(argument)


#: The key of a section held in a dict (runtime.engines.<kind>), which a field read cannot see.
ANY_KEY = "*"


def section_paths(model: type[BaseModel], prefix: str = "") -> dict[type[BaseModel], str]:
    """Dotted path of every section class under `model` ("" for the run config itself)."""
    paths: dict[type[BaseModel], str] = {model: prefix} if not prefix else {}
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        held = f"{path}.{ANY_KEY}" if typing.get_origin(field.annotation) is dict else path
        for section in model_classes_in(field.annotation):
            paths[section] = held
            paths.update(section_paths(section, held))
    return paths


def covers(declared: str, field: str) -> bool:
    """Whether a declared name (a section or a field) covers a recorded field; ANY_KEY matches any dict key."""
    names, parts = declared.split("."), field.split(".")
    return len(names) <= len(parts) and all(part in (name, ANY_KEY) for name, part in zip(names, parts))


#: pydantic's ways to read a whole model at once.
DUMPS = ("model_dump", "model_dump_json")


class ConfigReads:
    """Records the config fields read inside a `with` block, in `self.fields`."""

    def __init__(self) -> None:
        self.paths = section_paths(RunConfig)
        self.fields: set[str] = set()

    def __enter__(self) -> "ConfigReads":
        original, paths, fields = BaseModel.__getattribute__, self.paths, self.fields

        def recording(instance: Any, name: str) -> Any:
            value = original(instance, name)
            section = type(instance)
            if section in paths and name in section.model_fields:
                if not any(True for _ in model_classes_in(section.model_fields[name].annotation)):
                    prefix = paths[section]
                    fields.add(f"{prefix}.{name}" if prefix else name)
            return value

        BaseModel.__getattribute__ = recording  # type: ignore[method-assign]
        self.dumps = {name: getattr(BaseModel, name) for name in DUMPS}
        for name, dump in self.dumps.items():
            setattr(BaseModel, name, self.recording_dump(dump))
        return self

    def recording_dump(self, dump: Any) -> Any:
        """A dump of a section reads all of it (a contract that embeds `regeneration` depends on every field);
        a dump of the whole run config is a record of it (config/run.yaml), not an input."""
        paths, fields = self.paths, self.fields

        def recording(instance: Any, *args: Any, **kwargs: Any) -> Any:
            prefix = paths.get(type(instance))
            if prefix:
                fields.add(prefix)
            return dump(instance, *args, **kwargs)

        return recording

    def __exit__(self, *exc: Any) -> None:
        del BaseModel.__getattribute__  # back to object's: BaseModel defines none of its own
        for name, dump in self.dumps.items():
            setattr(BaseModel, name, dump)

    def undeclared(self, declared: typing.Iterable[str], ignored: typing.Iterable[str] = ()) -> list[str]:
        """Fields read that no declared name (a section or a field) covers."""
        names = [*declared, *ignored]
        return sorted(field for field in self.fields if not any(covers(name, field) for name in names))
