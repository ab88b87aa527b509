"""causalboard's application layer: HTTP API, client, CLI and dashboard. Never imports vLLM."""
