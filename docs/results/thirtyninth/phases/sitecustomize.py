"""Diagnostic only (thirty-ninth session; on PYTHONPATH, imported by every Python process of a bench run): the
host time of each engine step by phase and step kind, written at exit to /tmp/phases_<pid>.txt, one line per step:
"<kind> <schedule us> <plan us> <launch us> <resolve us> <total us>". launch: the worker enqueueing the forward
and the sampler (eager steps: every kernel launch); resolve: waiting for the previous step's tokens and their
bookkeeping."""
import atexit
import os
import time


def _install() -> None:
    try:
        from nanovllm.engine import llm_engine, model_runner, scheduler, step_plan, worker
    except Exception:  # noqa: BLE001 - not a process of this tree
        return
    rows: list[list] = []
    current: dict = {}

    def timed(cls, name, phase):
        inner = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(self, *args, **kwargs)
            finally:
                current[phase] = current.get(phase, 0.0) + time.perf_counter() - start
        setattr(cls, name, wrapper)

    timed(scheduler.Scheduler, "schedule", "schedule")
    timed(step_plan.StepPlanner, "plan", "plan")
    timed(worker.Worker, "launch", "launch")
    timed(llm_engine.LLMEngine, "_resolve_pending", "resolve")
    inner_step = llm_engine.LLMEngine._run_step

    def run_step(self, final_only):
        current.clear()
        before = tuple(self.runner.planner.steps)
        start = time.perf_counter()
        try:
            return inner_step(self, final_only)
        finally:
            total = time.perf_counter() - start
            changed = [i for i, (a, b) in enumerate(zip(before, self.runner.planner.steps)) if a != b]
            kind = step_plan.STEP_KINDS[changed[0]] if changed else "none"
            rows.append([kind] + [int(1e6 * current.get(p, 0.0)) for p in ("schedule", "plan", "launch", "resolve")]
                        + [int(1e6 * total)])
            if len(rows) % 50 == 0:
                dump()
    llm_engine.LLMEngine._run_step = run_step

    def dump():
        if rows:
            with open(f"/tmp/phases_{os.getpid()}.txt", "w") as f:  # the whole list again: a kill loses little
                f.writelines(" ".join(map(str, r)) + "\n" for r in rows)
    atexit.register(dump)
    del model_runner


if os.environ.get("NANOVLLM_PHASES"):
    _install()
