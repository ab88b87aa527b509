"""Python client for the causalboard HTTP API (sync and asyncio, on httpx).

    from app.client import CausalboardClient
    with CausalboardClient("http://127.0.0.1:8000") as cb:
        res = cb.patch_sweep(prompt="Garrow is ruled by", clean_prompt="Guzar is ruled by",
                             answer_token=" Hadrian", metric="recovered")
"""

from app.client.http import AsyncCausalboardClient, CaptureResult, CausalboardClient, CausalboardError, SweepFailed

__all__ = ["AsyncCausalboardClient", "CaptureResult", "CausalboardClient", "CausalboardError", "SweepFailed"]
