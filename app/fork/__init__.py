"""The reference fork's wire forms that more than one part of `app/` reads: its packed vector
tiers and registries (`vectors`), its dimension masks (`masks`) and steering modules as patch
sources (`steering_modules`). Plain parsing on top of `engine_ext` (no FastAPI, no vLLM), so
`app/api` and `app/sweep` both import it without depending on each other."""
