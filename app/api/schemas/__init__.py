"""Request and response bodies of the HTTP API (pydantic: the one canonical wire form)."""
