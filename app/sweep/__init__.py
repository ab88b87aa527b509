"""Patch sweeps: wire schema, plan, alignment, service and result (no FastAPI, no plotting)."""
