"""Shared route dependencies."""

from __future__ import annotations

from fastapi import Request

from engine_ext import Engine


def get_engine(request: Request) -> Engine:
    """The app's engine (set by `create_app`)."""
    return request.app.state.engine
