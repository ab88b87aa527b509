"""The HTTP API (FastAPI): app factory, dependencies, auth, errors, SSE framing, schemas, routes and the reference fork's compatibility layer."""
