"""Turning YAML files and CLI overrides into a `RunConfig`, with errors a person can act on.

An error names the file, the dotted path of the field, what was wrong and, for a misspelt key,
the closest valid key ("unknown field 'lerning_rate' in training; did you mean 'learning_rate'?").
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import BaseModel, ValidationError

from contract.config import RunConfig
from contract.secrets import is_secret_location, redacted_dump


class ConfigError(ValueError):
    """A run config that cannot be used; the message lists every problem found."""


class ConfigYamlLoader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true/false. PyYAML (YAML 1.1) reads `off`/`on`/`yes`/`no` as booleans, but
    DVC rewrites params.yaml (`dvc exp run -S`) in YAML 1.2, where `reasoning: off` is left unquoted."""


ConfigYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=ConfigYamlLoader)


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """Load a run config from YAML (or the defaults when `path` is None) and apply overrides."""
    origin = str(path) if path is not None else "<defaults>"
    raw = read_yaml(Path(path)) if path is not None else {}
    for override in overrides:
        apply_override(raw, override)
    return validate_config(raw, origin)


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping, or fail naming the file and the line of a syntax error."""
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = parse_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from error
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set `section.field=value` (value parsed as YAML, so `3`, `true`, `[1, 2]` keep their types)."""
    key, separator, text = override.partition("=")
    key = key.strip()
    if not separator or not key:
        raise ConfigError(f"override '{override}': expected section.field=value")
    try:
        value = parse_yaml(text) if text.strip() else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"override '{override}': value is not valid YAML: {error}") from error
    parts = key.split(".")
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"override '{override}': '{where}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def validate_config(raw: dict[str, Any], origin: str) -> RunConfig:
    """Validate a raw mapping; on failure raise one ConfigError naming every bad field."""
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as error:
        problems = [describe_error(item) for item in error.errors()]
        listing = "\n".join(f"  - {problem}" for problem in problems)
        raise ConfigError(f"{origin}: invalid run config:\n{listing}") from None


def describe_error(item: dict[str, Any]) -> str:
    """One pydantic error as a sentence with the dotted field path."""
    location = [str(part) for part in item["loc"]]
    dotted = ".".join(location)
    if item["type"] == "extra_forbidden":
        parent = ".".join(location[:-1]) or "the run config"
        unknown = location[-1]
        message = f"unknown field '{unknown}' in {parent}"
        suggestion = closest_field(item["loc"][:-1], unknown)
        if suggestion:
            message += f"; did you mean '{suggestion}'?"
        return message
    if item["type"] == "value_error":
        return f"{dotted or 'run config'}: {item['msg'].removeprefix('Value error, ')}"
    return f"{dotted}: {item['msg']} (got {shown_input(item)})"


def shown_input(item: dict[str, Any]) -> str:
    """The rejected value as an error message may show it: never a secret field's."""
    got = item.get("input")
    if is_secret_location(item["loc"]):
        return "a value of a secret field, not shown"
    return repr(got) if not isinstance(got, dict) else "a mapping"


def closest_field(parent_location: tuple[Any, ...], unknown: str) -> str | None:
    """The valid key nearest to a misspelt one, found by walking the model tree to its parent."""
    model: type[BaseModel] | None = RunConfig
    for part in parent_location:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(str(part))
        model = field_model(field.annotation) if field else None
    if model is None:
        return None
    matches = difflib.get_close_matches(unknown, list(model.model_fields), n=1, cutoff=0.6)
    return matches[0] if matches else None


def field_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (`Section`, `list[Section]`, `Optional[Section]`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in getattr(annotation, "__args__", ()):
        found = field_model(argument)
        if found is not None:
            return found
    return None


def config_as_yaml(config: RunConfig) -> str:
    """The fully resolved config (defaults filled in), as a person would write it, secrets redacted
    (contract/secrets.py): what run.yaml, checkpoints and `eaglet config show` hold."""
    return yaml.safe_dump(redacted_dump(config), sort_keys=False)


def flatten_config(config: RunConfig) -> dict[str, str]:
    """Dotted key → string value, the shape MLflow params want (secrets redacted)."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, child in value.items():
                walk(f"{prefix}.{key}" if prefix else key, child)
        else:
            flat[prefix] = str(value)

    walk("", redacted_dump(config))
    return flat
