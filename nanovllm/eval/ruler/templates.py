"""RULER's task templates and answer prefixes, and the prompt wrapper that measures the token budget.

A full prompt is ``wrapper(task_text) + answer_prefix``: the answer prefix is a prefill of the
assistant turn and the model continues after it. Every answer prefix starts with a space.
"""
from __future__ import annotations

NIAH_TEMPLATE = (
    "Some special magic {type} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type} afterwards.\n{context}\n"
    "What are all the special magic {type} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type} for {query} mentioned in the provided text are"

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assigned the value {query}, they are: "
)

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"

FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. {context}\n"
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other "
    "words.\n\nThe following are given documents.\n\n{context}\n\n"
    "Answer the question based on the given documents. Only give me the answer and do not output any other "
    "words.\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"

TEMPLATE_KINDS = ("chat", "base")


def singular(text: str) -> str:
    """RULER's rewrite of a NIAH template when exactly one value is asked for."""
    return text.replace("Some", "A").replace("are all", "is").replace("are", "is")


def niah_texts(type_plural: str, context: str, query: str, num_answers: int) -> tuple[str, str]:
    """(task text, answer prefix) of a NIAH sample; singular wording when there is one answer."""
    template, prefix, kind = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX, type_plural
    if num_answers == 1:
        template, prefix, kind = singular(template), singular(prefix), type_plural[:-1]
    return template.format(type=kind, context=context, query=query), prefix.format(type=kind, query=query)


class Prompter:
    """Builds full prompts for one tokenizer and template kind, and counts their tokens.

    ``template="chat"``: the tokenizer's chat template with the task text as the only user turn
    (``add_generation_prompt=True``), then the answer prefix. ``template="base"``: the bare task text,
    then the answer prefix. Tokens are counted without adding special tokens (no extra BOS).
    """

    def __init__(self, tokenizer, template: str = "chat"):
        if template not in TEMPLATE_KINDS:
            raise ValueError(f"template must be one of {TEMPLATE_KINDS}, got {template!r}")
        if template == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; use template='base'")
        self.tokenizer = tokenizer
        self.template = template

    def wrap(self, task_text: str) -> str:
        if self.template == "base":
            return task_text
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": task_text}], add_generation_prompt=True, tokenize=False
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}")
        return text

    def build(self, task_text: str, answer_prefix: str) -> str:
        return self.wrap(task_text) + answer_prefix

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=False, verbose=False)["input_ids"])

    def count(self, prompt: str) -> int:
        return len(self.encode(prompt))
