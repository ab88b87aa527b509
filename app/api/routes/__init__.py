"""HTTP routes, one module per area. `app.api.app.create_app` includes every router here.
Routes get the engine, settings and sweep service as dependencies (`app/api/deps.py`).

* `status`     — `GET /health`, `GET /v1/status`, `GET /v1/model/tasks`
* `tokens`     — `POST /v1/tokenize`
* `openai_compat` — vLLM's `POST /tokenize`, `/detokenize`, `GET /v1/models`, `POST /v1/chat/completions`
* `generation` — `POST /v1/generate` (+ SSE), `POST /v1/completions` (OpenAI + the fork's fields)
* `sweep`      — `POST /v1/patch_sweep` (+ SSE), sweep replay/status
* `steering`   — global steering, named vectors, steering modules
* `fork_registry` — the reference fork's named probe/steer vectors (`POST /v1/steering/vectors/register`, `/unregister`)
* `dynamic`    — dynamic steering: probes, global policies, status (`/v1/steering/probes`, `/v1/steering/dynamic`)
* `capture`    — capture runs, stored source runs (`DELETE /v1/patch_source/{run_id}`)
* `state_check` — `POST /v1/state_check`: the sentinel 4-arm recurrent-state check (hybrid models)
"""
