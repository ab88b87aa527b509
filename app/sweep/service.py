"""`SweepService`: runs patch sweeps on the engine and keeps each sweep's event log.

A sweep has two phases:

1. *Prepare* (`SweepService.start`, awaited by the HTTP handler, so every failure is a plain
   JSON error): plan (`build_plan`), capture the clean run when needed (one request that also
   scores the clean baseline and that the workers store *and lease* as they file it, so no other
   request's capture can evict it first), else lease the given source run; score the corrupt
   baseline alone (one request per noise sample); read the checksum status (all of these
   concurrently). Then the `start` event is logged.
2. *Fan-out* (a background task): one request per cell (x noise samples), submitted in groups
   through `Engine.agenerate_many` (one preparation and one hand-off to the engine loop per
   group, results as each request finishes), at most `max_concurrency` cells in flight, scored
   exactly on the answer/foil ids; unpatched corrupt baselines are re-run at evenly spaced points *inside* the cell batch, and as many cells are
   run a second time after all others — the largest deviation (baseline vs its solo run,
   repeat vs first run) is the noise floor. Cells are logged as they complete;
   a cell whose patch could not be applied (source run dropped/evicted, capacity) is voided
   (`value: null` + `error`), never reported with an unpatched value. Finally the lease is
   released — or the auto-captured run dropped (leased or not), unless `keep_source` — while
   the checksum status is read; then the checksum and the summary are logged.

Cancelling a sweep (client disconnect, `cancel`) aborts its in-flight requests, skips the rest,
releases the lease and drops the auto-captured run; its log ends with a summary marked
`cancelled`. Logs of the last `KEEP_FINISHED` sweeps stay readable (`GET .../events` replay).

Events and the summary are built as the models of `app/sweep/schema.py` (the wire format); the log
holds their JSON form.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

import anyio

from engine_ext import Engine, GenerationParams
from engine_ext.errors import EngineDeadError
from engine_ext.specs import Capture, Interventions
from engine_ext.sites import site_from_index

from app.sweep.plan import PlanError, SweepCell, SweepPlan, build_plan
from app.sweep.result import argmax_cell
from app.sweep.schema import (CellEvent, CellRef, CellRepeat, ChecksumEvent, ErrorEvent, HookGrid, NoiseFloorDetail,
                              NoiseFloorEvent, PatchSweepRequest, ProgressEvent, SkipEvent, StartEvent, SummaryEvent,
                              SweepAlignment, SweepChecksum, SweepEventModel, SweepNoise, SweepSetup, SweepSource,
                              SweepStatus, SweepSummary, VoidedCell, WarningEvent, WorkerChecksum)

logger = logging.getLogger("causalboard.sweep")

KEEP_FINISHED = 32
#: |clean - corrupt| below this makes `recovered` undefined
RECOVERED_EPS = 1e-6
PROGRESS_EVERY_S = 0.5
#: effects below this (metric units) count as "within noise" even when the measured floor is
#: smaller: float32 logprobs of differently batched requests differ at this scale
MIN_EFFECT = 1e-6
#: the fan-out submits its jobs in groups (one `Engine.agenerate_many` batch each) of at most this
#: many, and of at most a quarter of the in-flight limit, so the engine starts on the first group
#: while the next ones are prepared (256 since 2026-11-27: on an H200 the 768-cell sweep took a
#: median 0.30 s in groups of 256 against 0.36 s in groups of 128 and 0.35 s in one group;
#: docs/performance.md, "Fourteenth session")
GROUP_MAX = 256
GROUPS_PER_WINDOW = 4
#: a segmented sweep (several cells per request, `Engine.agenerate_cells`) submits up to this many
#: jobs as one group, whatever the engine's request limit (a request carries many cells), unless a
#: `max_concurrency` below their number says otherwise: the cells
#: then share as few engine steps as the token budget allows instead of one step per group
SEGMENTED_GROUP_MAX = 4096
#: every request of a sweep (clean capture, baselines, cells): one token whose scores are read; its
#: text is never used, so none is decoded
ONE_SCORED_TOKEN = GenerationParams(max_tokens=1, detokenize=False)


class SweepRun:
    """One sweep: its plan, its event log (`(id, event JSON)` pairs) and its lifecycle."""

    def __init__(self, plan: SweepPlan):
        self.plan = plan
        self.log: list[tuple[int, dict]] = []
        self.values: dict[tuple[str, int, int], float | None] = {}
        self.errors: dict[tuple[str, int, int], str] = {}
        self.state = "preparing"  # preparing | running | done | cancelled | failed
        self.task: asyncio.Task | None = None
        #: what the `start` event said (the summary repeats it)
        self.setup: SweepSetup | None = None
        #: the last checksum status logged
        self.checksum: SweepChecksum | None = None
        self.summary: SweepSummary | None = None
        self.started = time.monotonic()
        #: cells and baselines read the corrupt prompt's cached KV below their first modified
        #: position (`prefix_reuse`); the prompt tokens they read from the cache
        self.prefix_reuse = False
        #: cells run as the segments of shared requests (`Engine.agenerate_cells`)
        self.segmented = False
        #: those segments start their forward at their lowest patched layer (`_entry_run`)
        self.layer_entry = False
        #: a segmented sweep's one group of jobs, prepared while the clean run computes
        #: (`_prepare_group`): (`_jobs`, their requests' specs and owners, `Engine.prepare_cells`)
        self.prepared_group: tuple | None = None
        self.reused_tokens = 0
        #: the fan-out reached its cleanup (`cancel` is then a no-op)
        self.finishing = False
        self._wake = asyncio.Event()

    @property
    def sweep_id(self) -> str:
        return self.plan.sweep_id

    @property
    def finished(self) -> bool:
        return self.state in ("done", "cancelled", "failed")

    def emit(self, event: SweepEventModel) -> None:
        """Log an event (as JSON data) and wake the followers."""
        self.log.append((len(self.log), event.model_dump(mode="json")))
        self._notify()

    def close(self, state: str) -> None:
        self.state = state
        self._notify()

    def _notify(self) -> None:
        """Wake every `follow` waiting for news."""
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()

    async def follow(self, after: int = -1) -> AsyncIterator[tuple[int, dict]]:
        """Logged events with id > `after`, then live ones until the sweep ends."""
        i = after + 1
        while True:
            while i < len(self.log):
                yield self.log[i]
                i += 1
            if self.finished:
                return
            await self._wake.wait()

    def cancel(self) -> None:
        """Cancel the fan-out once, and never once it is finishing. A `Task.cancel()` that lands
        in `_fan_out`'s `finally` (a second cancel — an explicit DELETE racing the stream's
        disconnect — or a client that disconnects while a finished sweep logs its checksum and
        summary) would interrupt that cleanup (leases, the summary), leaving the sweep 'running'
        forever."""
        if self.finishing:
            return
        if self.task is not None and not self.task.done() and not self.task.cancelling():
            self.task.cancel()

    def status(self) -> SweepStatus:
        return SweepStatus(sweep_id=self.sweep_id, state=self.state, cells_total=len(self.plan.cells),
                           cells_done=len(self.values), elapsed_s=round(time.monotonic() - self.started, 3))


class _Baselines:
    def __init__(self) -> None:
        self.clean: float | None = None
        self.corrupt: float = math.nan
        self.corrupt_solo0: float = math.nan
        self.metric: str = ""
        self.notes: list[str] = []
        self.auto_captured = False
        self.capture_submitted = False
        self.leased: str | None = None
        #: the corrupt prompt's run stored for layer skipping (`_entry_run`), to drop at the end
        self.entry_run: str | None = None


class SweepService:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.runs: OrderedDict[str, SweepRun] = OrderedDict()

    # ---- registry ---------------------------------------------------------------------------
    def get(self, sweep_id: str) -> SweepRun | None:
        return self.runs.get(sweep_id)

    def status(self) -> dict:
        active = [r.status().model_dump() for r in self.runs.values() if not r.finished]
        return {"active": len(active), "sweeps": active, "recent": len(self.runs) - len(active)}

    def _remember(self, run: SweepRun) -> None:
        self.runs[run.sweep_id] = run
        finished = [k for k, r in self.runs.items() if r.finished]
        for k in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            del self.runs[k]

    async def cancel_all(self, timeout: float = 10.0) -> None:
        """Cancel every running sweep and wait (up to `timeout`) for their cleanup."""
        tasks = [r.task for r in self.runs.values() if r.task is not None and not r.task.done()]
        for run in list(self.runs.values()):
            run.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    # ---- phase 1: prepare ---------------------------------------------------------------------
    async def start(self, req: PatchSweepRequest) -> SweepRun:
        """Plan and prepare a sweep, log its `start` event and launch its fan-out. Raises
        SpecError / PlanError (nothing is left behind on failure)."""
        eng = self.engine
        stored = {}
        if req.source_run is not None:
            stored[req.source_run] = await anyio.to_thread.run_sync(eng.source_info, req.source_run)
        plan = build_plan(eng, req, stored)
        run = SweepRun(plan)
        run.segmented = segments_default(eng, plan) if req.prefix_reuse is None else (not req.prefix_reuse and segments_default(eng, plan, short=False))
        run.prefix_reuse = (prefix_reuse_default(eng.info) and not run.segmented) if req.prefix_reuse is None else req.prefix_reuse
        base = _Baselines()
        # the checksum status is read while phase 1 runs (one control round trip less before the cells)
        checksum = asyncio.ensure_future(self._read_checksum())
        try:
            await self._prepare(run, base, checksum)
        except BaseException:
            checksum.cancel()
            await self._cleanup(run, base, keep=False)
            raise
        self._remember(run)
        run.state = "running"
        run.task = asyncio.create_task(self._fan_out(run, base), name=f"sweep-{plan.sweep_id}")
        return run

    async def _prepare(self, run: SweepRun, base: _Baselines, checksum: asyncio.Future) -> None:
        """Phase 1: the clean side (`_prepare_clean`) and the corrupt prompt's solo baselines run
        concurrently (neither needs the other: one engine step instead of several round trips
        before the fan-out) unless `max_concurrency` is smaller than their number (then one after
        the other, so the limit holds here too); then the baselines' notes and the start event."""
        plan, eng, req = run.plan, self.engine, run.plan.request
        noises = [plan.noise_for(k) for k in range(plan.noise_samples)]
        # with prefix reuse, the solo baselines write the blocks the cells read (the fan-out starts after them)
        group = _group_jobs(run)
        entry = _entry_run(run, self.engine) if group is not None else None
        run.layer_entry = entry is not None
        if req.max_concurrency is None or req.max_concurrency >= 1 + len(noises):
            _, *scores = await _all_or_none(self._prepare_clean(run, base),
                                            *(self._score(run, plan.corrupt_ids, n, entry if k == 0 else None, base)
                                              for k, n in enumerate(noises)),
                                            self._prepare_group(run, group, entry))
            scores = scores[:len(noises)]
        else:
            await self._prepare_clean(run, base)
            scores = [await self._score(run, plan.corrupt_ids, n) for n in noises]
        solo = [plan.basis_of(v) for v in scores]
        if base.clean is None and req.clean_baseline is not None:
            base.clean = float(req.clean_baseline)
        elif base.clean is not None and req.clean_baseline is not None:
            base.notes.append(f"clean_baseline {req.clean_baseline} ignored: the clean run was measured ({base.clean:.6g})")

        info = eng.info
        if info.device == "cuda" and (info.enforce_eager or not info.batch_invariant):
            base.notes.append("batch-dependent GPU numerics (eager mode or batch invariance off): cells can differ from "
                              "their solo runs by more than the measured noise floor; see docs/validation.md")
        elif not info.batch_invariant:
            base.notes.append("batch invariance off: on hosts whose CPU GEMM is not row-invariant (AVX2 without "
                              "AVX-512) cells can differ from their solo runs in the last bits; see docs/validation.md")
        base.corrupt_solo0 = solo[0]
        base.corrupt = sum(solo) / len(solo)
        base.metric = plan.metric
        if plan.metric == "recovered" and base.clean is None:
            # a stored run and no clean value: the raw grid, as the fork returns it — but labelled
            # with its real unit (the fork would call raw values `recovered`)
            base.metric = plan.basis
            base.notes.append(f"recovered needs the clean baseline (give clean_prompt or clean_baseline); "
                              f"values are raw {plan.basis}")
        elif plan.metric == "recovered" and abs(base.clean - base.corrupt) < RECOVERED_EPS:
            base.metric = plan.basis
            base.notes.append(f"recovered is undefined: the clean and corrupt baselines are equal ({plan.basis} "
                              f"{base.clean:.6g} vs {base.corrupt:.6g}); values are raw {plan.basis}")

        run.setup = self._setup(run, base)
        run.emit(StartEvent(**dict(run.setup)))
        for note in base.notes:
            run.emit(WarningEvent(message=note))
        for s in plan.skipped_positions:
            run.emit(SkipEvent(**s))
        self._log_checksum(run, await checksum)

    async def _prepare_clean(self, run: SweepRun, base: _Baselines) -> None:
        """The clean side of phase 1: capture and store the clean run, leased by the workers as
        they store it (auto capture), else score the clean prompt when there is one; lease a
        given source run."""
        plan, eng, req = run.plan, self.engine, run.plan.request
        src = plan.source
        if src.capture:
            sites = [str(site_from_index(i)) for i in src.capture_sites]
            spec = Interventions(capture=Capture.make(sites, "all_prompt", keep_as=src.run_id, return_values=False,
                                                      lease=True),
                                 score_token_ids=plan.score_ids)
            base.capture_submitted = True
            gen = await eng.agenerate(plan.clean_ids, ONE_SCORED_TOKEN, spec)
            iv = gen.intervention
            if iv is None or iv.voided or iv.stored_as != src.run_id:
                errs = "; ".join(iv.errors) if iv else "no result"
                raise PlanError(507, "noise" if req.noise else "clean_prompt", f"the clean run could not be stored: {errs}")
            base.auto_captured = True
            base.leased = src.run_id  # stored on every worker = leased there
            base.clean = plan.basis_of(gen.scores[0])
        elif plan.clean_ids is not None:
            base.clean = plan.basis_of(await self._score(run, plan.clean_ids, None))
        if src.run_id is not None and base.leased is None:
            if not await anyio.to_thread.run_sync(eng.lease_source, src.run_id):
                raise PlanError(404, "source_run", f"run {src.run_id!r} vanished from the source store before it could be leased")
            base.leased = src.run_id

    async def _prepare_group(self, run: SweepRun, jobs_repeats: tuple | None, entry_run: str | None = None) -> None:
        """A segmented sweep that submits all its jobs as one group (`_group_jobs`: its `_jobs`,
        None for other sweeps, which have nothing to prepare here): its requests
        are built here, on the host, while the engine computes the clean run and the baselines
        (this coroutine runs after theirs have been submitted), so the fan-out submits them at
        once (`run.prepared_group`). They are built in a worker thread: up to `SEGMENTED_GROUP_MAX`
        cells take tens of milliseconds (more on a slow CPU), which would otherwise keep the API's
        event loop from every other request and stream meanwhile. With `entry_run` (the corrupt
        baseline's stored run, `_entry_run`) the cells skip the layers below their own."""
        plan = run.plan
        if jobs_repeats is None:
            return
        await asyncio.sleep(0)  # the clean run's and the baselines' requests first ...
        await self.engine.handed_over()  # ... and handed to vLLM before this holds the GIL for a while

        def build() -> tuple:
            specs, owner = _group_specs(plan, jobs_repeats[0])
            return jobs_repeats, specs, owner, self.engine.prepare_cells(plan.corrupt_ids, specs, plan.score_ids,
                                                                         entry_run=entry_run)

        run.prepared_group = await anyio.to_thread.run_sync(build)

    async def _score(self, run: SweepRun, ids: list[int], noise, keep_as: str | None = None,
                     base: _Baselines | None = None) -> dict[int, float]:
        """A baseline's scores. With `keep_as` (the corrupt baseline of a sweep that skips layers):
        also stores (leased) its `pre_attn` at every layer and position under that name, noted in
        `base` for the cleanup."""
        # a baseline is computed like the cells: from the prefix cache with prefix reuse, else fresh
        spec = _spec(run.plan, noise)
        if keep_as is not None:
            sites = [f"L{layer}.pre_attn" for layer in range(self.engine.info.num_layers)]
            spec = dataclasses.replace(spec, capture=Capture.make(sites, "all_prompt", keep_as=keep_as,
                                                                  return_values=False, lease=True))
            base.entry_run = keep_as
        gen = await self.engine.agenerate(ids, ONE_SCORED_TOKEN, spec, fresh=not run.prefix_reuse)
        if gen.intervention is not None and gen.intervention.voided:
            raise _Voided("; ".join(gen.intervention.errors) or "voided")
        run.reused_tokens += gen.num_cached_tokens
        return gen.scores[0]

    # ---- phase 2: fan-out -----------------------------------------------------------------------
    async def _fan_out(self, run: SweepRun, base: _Baselines) -> None:
        plan = run.plan
        limit = plan.request.max_concurrency or max(1, self.engine.info.max_num_seqs)
        results: asyncio.Queue = asyncio.Queue()
        n = len(plan.cells)
        k_nf = plan.request.noise_floor_samples
        in_batch: list[float] = []
        tasks: list[asyncio.Task] = []

        raw: dict[tuple[str, int, int], float] = {}
        repeats: dict[tuple[str, int, int], float] = {}
        prepared, run.prepared_group = run.prepared_group, None
        # with a prepared group: the very job list it was built from
        jobs, repeat_at = prepared[0] if prepared is not None else _jobs(plan)
        if run.segmented and plan.request.max_concurrency is None:
            group = limit = max(1, min(len(jobs), SEGMENTED_GROUP_MAX))
        elif _one_group(run, jobs):  # a limit that allows every job at once
            group = len(jobs)
        else:
            group = max(1, min(GROUP_MAX, -(-limit // GROUPS_PER_WINDOW)))
        slots = asyncio.Semaphore(limit)  # jobs (a cell with its noise samples, or a baseline) in flight

        async def group_job(chunk: list[tuple[str, SweepCell | None]]) -> None:
            """One batch of jobs through `Engine.agenerate_many`; each job's result is queued as
            soon as all its requests are in, and its slot freed."""
            if prepared is not None and prepared[0][0] is chunk:  # built while the clean run computed
                _, specs, owner, cells = prepared
            else:
                specs, owner = _group_specs(plan, chunk)
                cells = None
            vals: list[list[float | None]] = [[None] * (1 if kind == "baseline" else plan.noise_samples) for kind, _ in chunk]
            left = [len(v) for v in vals]
            errs: list[str | None] = [None] * len(chunk)
            if cells is not None:
                batch = self.engine.arun_cells(cells)
            elif run.segmented:  # several cells per request (`Engine.agenerate_cells`)
                batch = self.engine.agenerate_cells(plan.corrupt_ids, specs, plan.score_ids)
            else:
                batch = self.engine.agenerate_many([plan.corrupt_ids] * len(specs), ONE_SCORED_TOKEN, specs,
                                                   fresh=not run.prefix_reuse)
            async with contextlib.aclosing(batch) as finished:
                async for r, res in finished:
                    j, k = owner[r]
                    kind, cell = chunk[j]
                    try:
                        if isinstance(res, Exception):
                            raise res
                        if res.intervention is not None and res.intervention.voided:
                            raise _Voided("; ".join(res.intervention.errors) or "voided")
                        vals[j][k] = plan.basis_of(res.scores[0])
                        run.reused_tokens += res.num_cached_tokens
                    except _Voided as exc:
                        errs[j] = errs[j] or str(exc)
                    except Exception as exc:
                        if kind == "baseline":  # a baseline that fails (not voided) ends the sweep
                            raise
                        # one cell failing must not take the sweep down
                        if errs[j] is None:
                            logger.error("sweep %s: cell %s failed", plan.sweep_id, cell, exc_info=exc)
                            errs[j] = f"{type(exc).__name__}: {exc}"
                    left[j] -= 1
                    if not left[j]:
                        value = None if errs[j] is not None else sum(vals[j]) / len(vals[j])
                        results.put_nowait((kind, cell, value, errs[j]))
                        slots.release()

        def report_failure(task: asyncio.Task) -> None:  # a job that raised ends the sweep
            if not task.cancelled() and task.exception() is not None:
                results.put_nowait(("failed", None, None, task.exception()))

        async def feed() -> None:
            """Submit the jobs in groups, at most `limit` jobs in flight."""
            for start in range(0, len(jobs), group):
                chunk = jobs if group >= len(jobs) else jobs[start: start + group]
                for _ in chunk:
                    await slots.acquire()
                t = asyncio.create_task(group_job(chunk))
                t.add_done_callback(report_failure)
                tasks.append(t)

        state = "done"
        waiter: asyncio.Future | None = None
        try:
            feeder = asyncio.create_task(feed())
            feeder.add_done_callback(report_failure)
            tasks.append(feeder)
            pending = len(jobs)
            last_progress = 0.0
            while pending:
                waiter = asyncio.ensure_future(results.get())
                got = [await waiter]
                while not results.empty():  # a group's burst: one wake-up for all its results
                    got.append(results.get_nowait())
                for kind, cell, value, error in got:
                    if kind == "failed":
                        raise error
                    pending -= 1
                    if kind in ("baseline", "repeat"):
                        if value is not None:
                            if kind == "baseline":
                                in_batch.append(value)
                            else:
                                repeats[cell.key] = value
                            if in_batch:
                                nf = self._noise_floor(in_batch, base, _pairs(raw, repeats))
                                run.emit(NoiseFloorEvent(**dict(nf), final=len(in_batch) + len(repeats) == k_nf + len(repeat_at)))
                        continue
                    if value is not None:
                        raw[cell.key] = value
                    shown = None if value is None else self._metric(value, base)
                    run.values[cell.key] = shown
                    if value is None:
                        run.errors[cell.key] = error
                    run.emit(CellEvent(hook=cell.hook, layer=cell.layer, position=cell.position, value=shown, error=error, raw=value))
                    now = time.monotonic()
                    if now - last_progress >= PROGRESS_EVERY_S or len(run.values) == n:
                        last_progress = now
                        run.emit(self._progress(run))
        except asyncio.CancelledError:
            state = "cancelled"
        except EngineDeadError as exc:
            state = "failed"
            run.emit(ErrorEvent(error=f"engine: {exc}"))
        except Exception as exc:
            state = "failed"
            logger.exception("sweep %s failed", plan.sweep_id)
            run.emit(ErrorEvent(error=f"{type(exc).__name__}: {exc}"))
        finally:
            run.finishing = True  # from here on nothing may cancel this task (see SweepRun.cancel)
            if waiter is not None:
                waiter.cancel()
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)  # aborts their engine requests
            keep = state == "done" and plan.request.keep_source
            if state == "done":  # the lease (or run) goes while the final checksum status is read
                _, checksum = await asyncio.gather(self._cleanup(run, base, keep=keep), self._read_checksum())
                self._log_checksum(run, checksum)
            else:
                await self._cleanup(run, base, keep=keep)
            run.summary = self._summary(run, base, in_batch, _pairs(raw, repeats), cancelled=state != "done")
            run.emit(SummaryEvent(**dict(run.summary)))
            run.close(state)

    # ---- helpers ------------------------------------------------------------------------------
    async def _cleanup(self, run: SweepRun, base: _Baselines, keep: bool) -> None:
        src = run.plan.source
        try:
            with anyio.CancelScope(shield=True):  # runs while the sweep is being cancelled
                await self._release(src, base, keep)
        except Exception:  # the engine may be gone; nothing else to release then
            logger.exception("sweep %s: cleanup failed", run.sweep_id)

    async def _release(self, src, base: _Baselines, keep: bool) -> None:
        """One engine call: drop the auto-captured run (dropping removes a leased run too), else
        release the lease; and beside it, drop the run stored for layer skipping."""
        leased, base.leased = base.leased, None
        entry, base.entry_run = base.entry_run, None
        calls = []
        if src.capture and base.capture_submitted and not keep:
            calls.append(anyio.to_thread.run_sync(self.engine.drop_source, src.run_id))
        elif leased is not None:
            calls.append(anyio.to_thread.run_sync(self.engine.release_source, leased))
        if entry is not None:
            calls.append(anyio.to_thread.run_sync(self.engine.drop_source, entry))
        if calls:
            await asyncio.gather(*calls)

    async def _read_checksum(self) -> SweepChecksum:
        """The engine's checksum status as the sweep reports it (an error in it, never raised).
        Its call is queued for the engine after whatever the tasks scheduled with it submit."""
        await asyncio.sleep(0)
        try:
            status = await self.engine.aintervention_status()
            return SweepChecksum(**status["determinism"], workers=[
                WorkerChecksum(**{k: w.get(k) for k in ("tp_rank", "pp_rank", "action_checksum", "action_count")})
                for w in status["workers"]])
        except Exception as exc:
            return SweepChecksum(consistent=None, error=str(exc))

    @staticmethod
    def _log_checksum(run: SweepRun, checksum: SweepChecksum) -> None:
        run.checksum = checksum
        run.emit(ChecksumEvent(**dict(checksum)))

    def _metric(self, basis_value: float, base: _Baselines) -> float:
        if base.metric == "recovered":
            return (basis_value - base.corrupt) / (base.clean - base.corrupt)
        return basis_value

    def _noise_floor(self, in_batch: list[float], base: _Baselines, repeated: list[CellRepeat] | None = None) -> NoiseFloorDetail:
        """Largest deviation (metric units) of an in-batch baseline from the solo baseline, or of
        a repeated cell from its first run."""
        repeated = repeated or []
        dev = max([abs(v - base.corrupt_solo0) for v in in_batch] + [abs(r.repeat - r.first) for r in repeated])
        if base.metric == "recovered":
            dev /= abs(base.clean - base.corrupt)
        return NoiseFloorDetail(value=dev, solo=base.corrupt_solo0, in_batch=list(in_batch), cell_repeats=repeated,
                                units=base.metric)

    def _progress(self, run: SweepRun) -> ProgressEvent:
        elapsed = time.monotonic() - run.started
        done = len(run.values)
        return ProgressEvent(done=done, total=len(run.plan.cells), voided=len(run.errors), elapsed_s=round(elapsed, 3),
                             cells_per_s=round(done / elapsed, 3) if elapsed > 0 else None)

    def _setup(self, run: SweepRun, base: _Baselines) -> SweepSetup:
        """What the sweep is, once its baselines are known: the `start` event's fields."""
        plan = run.plan
        eng, req, src, a = self.engine, plan.request, plan.source, plan.alignment
        return SweepSetup(
            sweep_id=plan.sweep_id, layers=plan.layers, positions=plan.run_positions, swept_positions=plan.positions,
            hook=plan.hooks[0], hooks=plan.hooks,
            metric=base.metric, metric_requested=plan.metric,
            recovered_basis=req.recovered_basis if plan.metric == "recovered" else None,
            auto_captured=base.auto_captured, captured_source_run=src.run_id if base.auto_captured else None,
            cells_total=len(plan.cells), clean=base.clean, corrupt=base.corrupt,
            alignment=SweepAlignment(**a.to_json()) if a else None,
            model=eng.info.model, prompt=req.prompt, clean_prompt=req.clean_prompt if req.noise is None else req.prompt,
            prompt_token_ids=plan.corrupt_ids, token_strings=eng.token_strings(plan.corrupt_ids),
            clean_token_ids=plan.clean_ids,
            clean_token_strings=eng.token_strings(plan.clean_ids) if plan.clean_ids is not None else None,
            answer_token_id=plan.answer_id, answer_token=eng.token_strings([plan.answer_id])[0],
            foil_token_id=plan.foil_id, foil_token=eng.token_strings([plan.foil_id])[0] if plan.foil_id is not None else None,
            alpha=req.alpha, source=SweepSource(**src.to_json()), subject_positions=plan.subject_positions,
            mask=plan.mask.to_json() if plan.mask is not None else None,
            prefix_reuse=run.prefix_reuse, segmented=run.segmented, layer_entry=run.layer_entry,
            noise=(SweepNoise(positions=plan.noise_positions, scale=req.noise.scale, seed=req.noise.seed,
                              samples=req.noise.samples) if req.noise else None),
        )

    def _summary(self, run: SweepRun, base: _Baselines, in_batch: list[float], repeated: list[CellRepeat],
                 cancelled: bool) -> SweepSummary:
        plan = run.plan
        nf = self._noise_floor(in_batch, base, repeated) if in_batch else None
        floor = nf.value if nf else None
        threshold = max(floor, MIN_EFFECT) if floor is not None else None
        corrupt_metric = 0.0 if base.metric == "recovered" else base.corrupt
        hook_grids, within = [], []
        cols = plan.run_positions  # the fork's axis: unaligned positions left out
        for hook in plan.hooks:
            grid = [[run.values.get((hook, l, p)) for p in cols] for l in plan.layers]
            hook_grids.append(HookGrid(hook=hook, grid=grid, argmax=argmax_cell(grid, plan.layers, cols)))
            if threshold is not None:
                within += [CellRef(hook=hook, layer=l, position=p) for l in plan.layers for p in cols
                           if run.values.get((hook, l, p)) is not None and abs(run.values[(hook, l, p)] - corrupt_metric) <= threshold]
        voided = [VoidedCell(hook=h, layer=l, position=p, reason=e) for (h, l, p), e in run.errors.items()]
        notes = list(base.notes)
        if cancelled:
            notes.append(f"cancelled after {len(run.values)} of {len(plan.cells)} cells")
        return SweepSummary(
            **dict(run.setup),
            grid=hook_grids[0].grid, argmax=hook_grids[0].argmax, hook_grids=hook_grids if plan.request.hooks is not None else None,
            skipped=list(plan.skipped_positions) + voided,
            noise_floor=floor, noise_floor_detail=nf, within_noise=within, within_noise_threshold=threshold,
            source_kept=base.auto_captured and plan.request.keep_source and not cancelled,
            checksum=run.checksum,
            cells_done=len(run.values), cells_voided=len(run.errors),
            elapsed_s=round(time.monotonic() - run.started, 3), cancelled=cancelled,
            reused_prompt_tokens=run.reused_tokens,
            notes=notes, versions=dict(self.engine.info.versions),
        )


def _group_jobs(run: SweepRun) -> tuple | None:
    """The `_jobs` of a sweep that submits them as one prepared group (`_one_group`), else None."""
    if not run.segmented:
        return None
    jobs_repeats = _jobs(run.plan)
    return jobs_repeats if _one_group(run, jobs_repeats[0]) else None


def _one_group(run: SweepRun, jobs: list) -> bool:
    """Whether a sweep submits all its `jobs` as one group: segmented, at most
    `SEGMENTED_GROUP_MAX` of them, and a `max_concurrency` (if any) that allows them all at once."""
    limit = run.plan.request.max_concurrency
    return run.segmented and 0 < len(jobs) <= SEGMENTED_GROUP_MAX and (limit is None or limit >= len(jobs))


def _jobs(plan: SweepPlan) -> tuple[list[tuple[str, SweepCell | None]], list[int]]:
    """The fan-out's jobs in submission order — the noise floor's baselines at evenly spaced
    points inside the cells, then the repeats: cells run a second time after all the others (other
    batch neighbours), whose differences join the baselines in the noise floor — and the indices of
    the repeated cells."""
    n, k_nf = len(plan.cells), plan.request.noise_floor_samples
    nf_at = {int((j + 0.5) * n / k_nf) for j in range(k_nf)}
    repeat_at = sorted(nf_at)
    jobs: list[tuple[str, SweepCell | None]] = []
    for i, cell in enumerate(plan.cells):
        if i in nf_at:
            jobs.append(("baseline", None))
        jobs.append(("cell", cell))
    jobs += [("repeat", plan.cells[i]) for i in repeat_at]
    return jobs, repeat_at


def _group_specs(plan: SweepPlan, chunk: list[tuple[str, SweepCell | None]]) -> tuple[list[Interventions], list[tuple[int, int]]]:
    """Per request of a group of jobs: its spec, and (its job's index in `chunk`, its noise sample)."""
    specs, owner = [], []
    for j, (kind, cell) in enumerate(chunk):
        for k in range(1 if kind == "baseline" else plan.noise_samples):
            specs.append(_spec(plan, plan.noise_for(k), None if kind == "baseline" else plan.patch_for(cell)))
            owner.append((j, k))
    return specs, owner


async def _all_or_none(*coros):
    """Await coroutines concurrently and return their results in order; when one raises (or the
    caller is cancelled), cancel the others, wait for them, and raise that first exception as is
    (no exception group: the callers' `PlanError`s keep their type)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def segments_default(eng, plan, short: bool = True) -> bool:
    """Whether a sweep runs its cells as the segments of shared requests (`Engine.agenerate_cells`,
    docs/segmented-cells.md): where the engine would (`Engine.segment_layout`: it can, and padding
    the prompt to whole KV blocks costs little), the cells have nothing but their patch (no noise
    corruption), and — unless the request turned prefix reuse off itself (`short=False`) — the
    prompt is shorter than two KV blocks, where prefix reuse saves a cell at most one block."""
    n = len(plan.corrupt_ids)
    if plan.request.noise is not None or eng.segment_layout(n) is None:
        return False
    return not short or n < 2 * eng.segment_block


def prefix_reuse_default(info) -> bool:
    """Whether a sweep reuses the corrupt prompt's cached KV when the request does not say: where
    a reused cell is bit-identical to the same cell computed from scratch, i.e. with batch
    invariance on, the default on both devices (CPU: tests/test_sweep_prefix_reuse.py; GPU:
    `benchmarks/gpu_sweep.py` check `prefix_reuse_exact`, `benchmarks/diag/sweep_http.py
    --prefix-reuse both`; docs/performance.md). Without it a GPU engine computes no cell exactly
    twice, reused or not, and a CPU engine does so only where the host's GEMM happens to be
    row-invariant, so there it stays opt-in (`prefix_reuse: true`)."""
    return bool(info.batch_invariant)


def _pairs(raw: dict[tuple[str, int, int], float], repeats: dict[tuple[str, int, int], float]) -> list[CellRepeat]:
    """Repeated cells whose both runs have a value (basis units)."""
    return [CellRepeat(hook=k[0], layer=k[1], position=k[2], first=raw[k], repeat=v)
            for k, v in sorted(repeats.items()) if k in raw]


def _entry_run(run: SweepRun, engine: Engine) -> str | None:
    """The name under which a segmented sweep stores its corrupt baseline's `pre_attn` at every
    layer, so that its cells skip the layers below their own (`Engine.agenerate_cells(entry_run=)`;
    docs/segmented-cells.md, "Layer skipping"), or None: the sweep has noise (its baselines are
    noise samples, not the corrupt prompt's own run), or the engine does not offer it
    (`Engine.layer_entry_offered`). Asked only for a sweep that submits its cells as one prepared
    group (`_group_jobs`: segmented)."""
    if run.plan.request.noise or not engine.layer_entry_offered:
        return None
    return f"{run.plan.sweep_id}-entry"


def _spec(plan: SweepPlan, noise, patch=None) -> Interventions:
    """A sweep request's spec: the corrupt prompt's noise sample, the cell's patch (none for a
    baseline), scored exactly on the answer/foil ids."""
    return Interventions(patch=(patch,) if patch is not None else (), noise=noise, score_token_ids=plan.score_ids)


class _Voided(Exception):
    """A request the workers voided (its patch could not be applied)."""
