"""What the engine reads from a model directory besides the weights: the tokenizer, the EOS token ids and
the sampling defaults of generation_config.json."""
from __future__ import annotations

from pathlib import Path

from nanovllm.config import read_json_object
from nanovllm.sampling_params import SamplingParams

GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_dir: Path) -> dict:
    """SamplingParams fields set by the model's generation_config.json (vLLM's `--generation-config auto`:
    temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens); checked here."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    config = read_json_object(path)
    defaults = {ours: config[theirs] for theirs, ours in GENERATION_FIELDS.items() if config.get(theirs) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    return defaults


def load_tokenizer(model_dir: Path):
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def eos_token_ids(model_dir: Path, hf_config: dict, tokenizer) -> set[int]:
    ids: set[int] = set()

    def add(value) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    add(hf_config.get("eos_token_id"))
    gen_config = model_dir / "generation_config.json"
    if gen_config.is_file():
        add(read_json_object(gen_config).get("eos_token_id"))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return ids
