"""Which run-config fields hold credentials, and the redacted form every file, MLflow record and printout gets.

Secret: every value of `runtime.engines.<engine>.env`, `regeneration.engine_env`, `capture.engine_env` and
`benchmark.replay_engine_env` (an engine's environment is where tokens such as HF_TOKEN go), `regeneration.api_key`,
every value of `regeneration.headers`, and the userinfo of `tracking.tracking_uri` and `regeneration.base_url`: its
password (`https://user:***@host`), or all of it when there is no password (`https://***@host`, a token given as the
user name). Each becomes `***`.

A config read back from a redacted copy (a run's `config/run.yaml`, `eaglet config show`) still loads and runs
everything that does not need a secret; the code that needs one takes it through `unredacted`,
`unredacted_mapping` or `unredacted_url`, which name the field when they find `***` instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import BaseModel

REDACTED = "***"
WILDCARD = "*"


class SecretUnavailable(ValueError):
    """A secret the run needs is not there: the config holds its redacted form, or its variable is unset."""


def redacted_mapping(mapping: Mapping[str, Any]) -> dict[str, str]:
    """The keys kept (they say what is set), every value hidden."""
    return {key: REDACTED for key in mapping}


def redacted_value(value: Any) -> str:
    """Any set value becomes the marker (the signature every redaction in SECRET_FIELDS shares)."""
    return REDACTED


@dataclass(frozen=True)
class UrlCredentials:
    """A URL split into where it points and the userinfo it carried (None: not given)."""

    url: str
    username: Optional[str] = field(default=None, repr=False)
    password: Optional[str] = field(default=None, repr=False)


def split_userinfo(url: str) -> UrlCredentials:
    """`scheme://user:password@host/path` → the URL without `user:password@`, and the (percent-decoded) parts."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return UrlCredentials(url)
    userinfo, _, host = parts.netloc.rpartition("@")
    username, separator, password = userinfo.partition(":")
    bare = urlunsplit(parts._replace(netloc=host))
    return UrlCredentials(bare, unquote(username), unquote(password) if separator else None)


def redacted_url(url: str) -> str:
    """The URL with its password (or, without one, its whole userinfo) replaced by `***`."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    username, separator, _ = userinfo.partition(":")
    hidden = f"{username}:{REDACTED}" if separator else REDACTED
    return urlunsplit(parts._replace(netloc=f"{hidden}@{host}"))


def redacted_urls(value: str | list[str]) -> str | list[str]:
    """`redacted_url` of one URL or of each URL of a list (replicas in `regeneration.base_url`)."""
    if isinstance(value, list):
        return [redacted_url(url) for url in value]
    return redacted_url(value)


#: Dotted config paths (`*`: any key) and how each is redacted.
SECRET_FIELDS: dict[str, Callable[[Any], Any]] = {
    "runtime.engines.*.env": redacted_mapping,
    "regeneration.engine_env": redacted_mapping,
    "capture.engine_env": redacted_mapping,
    "benchmark.replay_engine_env": redacted_mapping,
    "regeneration.headers": redacted_mapping,
    "regeneration.api_key": redacted_value,
    "regeneration.base_url": redacted_urls,
    "tracking.tracking_uri": redacted_url,
}


def redacted_dump(config: BaseModel) -> dict[str, Any]:
    """`config.model_dump(mode="json")` with every secret field redacted: what is written, logged or printed.
    An unset field (None) stays None."""
    tree = config.model_dump(mode="json")
    for pattern, redact in SECRET_FIELDS.items():
        for parent, key in places(tree, pattern.split(".")):
            if parent[key] is not None:
                parent[key] = redact(parent[key])
    return tree


def places(tree: dict[str, Any], path: Sequence[str]) -> list[tuple[dict[str, Any], str]]:
    """(mapping, key) of every field the dotted `path` names in `tree`."""
    parents = [tree]
    for part in path[:-1]:
        children = []
        for parent in parents:
            keys = list(parent) if part == WILDCARD else [part]
            children += [parent[key] for key in keys if isinstance(parent.get(key), dict)]
        parents = children
    return [(parent, path[-1]) for parent in parents if path[-1] in parent]


def is_secret_location(location: Sequence[Any]) -> bool:
    """True when a field location (e.g. a validation error's) lies in a secret field."""
    names = [str(part) for part in location]
    return any(lies_under(names, pattern.split(".")) for pattern in SECRET_FIELDS)


def lies_under(names: list[str], pattern: list[str]) -> bool:
    """`names` starts with the path `pattern` (`*` matching any one name)."""
    if len(names) < len(pattern):
        return False
    for want, got in zip(pattern, names):
        if want != WILDCARD and want != got:
            return False
    return True


def redacted_error(field_name: str) -> SecretUnavailable:
    return SecretUnavailable(
        f"{field_name} reads '{REDACTED}': this config is a redacted copy (a run's config/run.yaml, `eaglet config "
        "show`), which keeps no secret; set the real value to run what needs it")


def unredacted(value: str, field_name: str) -> str:
    """The secret itself, or SecretUnavailable naming the field when only its redacted form is there."""
    if value == REDACTED:
        raise redacted_error(field_name)
    return value


def unredacted_mapping(mapping: Mapping[str, str], field_name: str) -> dict[str, str]:
    """Every value through `unredacted`, as `<field_name>.<key>`."""
    return {key: unredacted(value, f"{field_name}.{key}") for key, value in mapping.items()}


def unredacted_url(url: str, field_name: str) -> UrlCredentials:
    """The URL split from its userinfo, or SecretUnavailable when the userinfo is the redacted form."""
    credentials = split_userinfo(url)
    hidden = credentials.password if credentials.password is not None else credentials.username
    if hidden == REDACTED:
        raise redacted_error(f"{field_name} (its userinfo)")
    return credentials
