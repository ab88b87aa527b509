"""HTTP routes, one module per area. `app.api.app.create_app` includes every router here.

* `sweep`    — `POST /v1/patch_sweep` (+ SSE), sweep replay/status
* `steering` — global steering, named vectors
* `capture`  — capture runs, stored source runs (`DELETE /v1/patch_source/{run_id}`)
"""
