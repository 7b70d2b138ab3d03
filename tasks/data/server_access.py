"""How the openai backend reaches its server: the URL requests go to and the headers every request carries.

Authorization is `Bearer <key>` when an API key is configured (`regeneration.api_key`, or the environment variable
`regeneration.api_key_env` names, read when the stage opens the server), else HTTP basic auth from the userinfo of
`regeneration.base_url` when it has one; `regeneration.headers` are added as given. The URL requests go to carries
no userinfo, so no error message or log line built from it can hold a credential.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass, field
from typing import Optional

from contract.config import RegenerationConfig
from contract.secrets import SecretUnavailable, unredacted, unredacted_mapping, unredacted_url


@dataclass(frozen=True)
class ServerAccess:
    base_url: str                                             # without userinfo, no trailing slash
    headers: dict[str, str] = field(default_factory=dict, repr=False)


def server_access(base_url: str, settings: RegenerationConfig) -> ServerAccess:
    """The server's URL and request headers; SecretUnavailable names a field whose secret is not there."""
    credentials = unredacted_url(base_url, "regeneration.base_url")
    headers: dict[str, str] = {}
    key = api_key(settings)
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    elif credentials.username is not None:
        headers["Authorization"] = basic_authorization(credentials.username, credentials.password or "")
    headers.update(unredacted_mapping(settings.headers, "regeneration.headers"))
    return ServerAccess(credentials.url.rstrip("/"), headers)


def api_key(settings: RegenerationConfig) -> Optional[str]:
    """The configured API key, None when there is none."""
    if settings.api_key is not None:
        return unredacted(settings.api_key.get_secret_value(), "regeneration.api_key")
    if settings.api_key_env is None:
        return None
    value = os.environ.get(settings.api_key_env)
    if not value:
        raise SecretUnavailable(f"regeneration.api_key_env names the environment variable {settings.api_key_env}, "
                                "which is not set: export it with the server's API key")
    return value


def basic_authorization(username: str, password: str) -> str:
    token = base64.b64encode(f"{username}:{password}".encode()).decode("ascii")
    return f"Basic {token}"
