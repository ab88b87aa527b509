"""The one way the dashboard's views (and notebooks using them) get an `AsyncCausalboardClient`.

    client, owned = async_client(None)                       # $CAUSALBOARD_URL, else http://127.0.0.1:8000
    client, owned = async_client("http://host:8000", api_key="s3cret")   # the key the page was given
    client, owned = async_client(sync_client)                # same server and key as a CausalboardClient
    client, owned = async_client(async_client_instance)      # used as is: owned is False

`owned` says whether the caller made the client (and so must close it). The API key is the one
passed in, or the one the given client already sends; the environment's `CAUSALBOARD_API_KEY` is
deliberately NOT read: the dashboard runs inside the API server's process, and a page that
picked up the server's own key would bypass the key prompt (`app/dashboard/app.py`).
"""

from __future__ import annotations

import os
from typing import Any

from app.client.http import AsyncCausalboardClient, CausalboardClient

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "CAUSALBOARD_URL"


def default_url() -> str:
    """`$CAUSALBOARD_URL`, else http://127.0.0.1:8000."""
    return os.environ.get(URL_ENV) or DEFAULT_URL


def api_key_of(client: CausalboardClient | AsyncCausalboardClient) -> str | None:
    """The bearer key a client sends (None when it sends none)."""
    auth = client._http.headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    return (key or None) if scheme.lower() == "bearer" else None


def async_client(client_or_url: Any = None, api_key: str | None = None) -> tuple[AsyncCausalboardClient, bool]:
    """(an async client, whether it was made here). `client_or_url`: None (`default_url()`), a
    base URL, a sync `CausalboardClient` (same URL; its key unless `api_key` is given) or an
    `AsyncCausalboardClient` (returned as is; `api_key` must then be None)."""
    if isinstance(client_or_url, AsyncCausalboardClient):
        if api_key is not None and api_key != api_key_of(client_or_url):
            raise ValueError("api_key: give the key to the AsyncCausalboardClient itself, not next to it")
        return client_or_url, False
    if client_or_url is None or isinstance(client_or_url, str):
        return AsyncCausalboardClient(client_or_url or default_url(), api_key=api_key), True
    if isinstance(client_or_url, CausalboardClient):
        key = api_key if api_key is not None else api_key_of(client_or_url)
        return AsyncCausalboardClient(client_or_url.base_url, api_key=key), True
    raise TypeError(f"expected a URL or a causalboard client, got {type(client_or_url).__name__}")


def sync_twin(client: AsyncCausalboardClient, timeout: float = 5.0) -> CausalboardClient:
    """A synchronous client for the same server and key (for clean-up where no event loop runs,
    e.g. at interpreter exit)."""
    return CausalboardClient(client.base_url, api_key=api_key_of(client), timeout=timeout)


__all__ = ["DEFAULT_URL", "URL_ENV", "api_key_of", "async_client", "default_url", "sync_twin"]
