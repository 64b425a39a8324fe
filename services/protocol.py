"""The per-request protocol settings: how a question becomes a prompt and passages become an observation.

Plain text rules, without transformers, so the request schema (`schemas.py`, also served store-only) and the agent
(`agent.py`, which tokenises) share them. The defaults are the gateway's own protocol: our instructions through
the tokenizer's chat template, passages rendered as Search-R1 renders them and cut to the observation budget
with the closing tag kept. Search-R1's own protocol is a set of values of these settings (docs/trainer.md,
"Search-R1's protocol").

A template names its slots in braces: `{question}` in the prompt, `{passages}` in the observation, `{i}`,
`{title}` and `{text}` in a passage; every other brace is plain text, and a slot's value is never read again
as a template.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

INSTRUCTIONS = (
    "Answer the question below. Every time you receive new information, reason about it first inside "
    "<think> and </think>. If some knowledge is missing, look it up by writing a search query as "
    "<search> query </search>; the best matching passages will come back between <information> and "
    "</information>. Search as many times as you need. Once you know the answer, give only the answer, "
    "without explanation, inside <answer> and </answer>, for example <answer> Paris </answer>."
)
PROMPT_TEMPLATE = INSTRUCTIONS + "\nQuestion: {question}\n"
CORRECTIVE = (
    "\nThat action was not valid. To search, put the query between <search> and </search>. "
    "To finish, put the final answer between <answer> and </answer>. Try again.\n"
)
# Search-R1's observation and passage formats (search_r1/llm_agent/generation.py: the `<information>` block of
# `execute_predictions`, one line per passage in `_passages2string`); the title is the first line of `contents`.
OBSERVATION_TEMPLATE = "\n\n<information>{passages}</information>\n\n"
PASSAGE_TEMPLATE = "Doc {i}(Title: {title}) {text}\n"
ChatTemplate = Literal[True, False, "auto"]
Truncation = Literal["passages", "whole"]


def fill(template: str, values: dict[str, str]) -> str:
    """`template` with each `{name}` of `values` replaced, in one pass (a value holding `{name}` stays as it is)."""
    pattern = "|".join(re.escape(name) for name in values)
    return re.sub(r"\{(" + pattern + r")\}", lambda m: values[m.group(1)], template)


def template_error(key: str, template: str, slot: str, *, once: bool = False) -> str | None:
    """Why `template` cannot serve as `key` (it lacks `{slot}`, or holds it more than once when `once`), or None."""
    count = template.count("{" + slot + "}")
    shown = template if len(template) <= 80 else template[:77] + "..."
    if count == 0:
        return f"{key} {shown!r} has no {{{slot}}}: it must say where the {slot} goes"
    if once and count > 1:
        return f"{key} {shown!r} holds {{{slot}}} {count} times; expected once"
    return None


@dataclass(frozen=True)
class ProtocolSpec:
    """One protocol; hashable, so a gateway builds the token pieces of each distinct one once."""

    prompt_template: str = PROMPT_TEMPLATE  # the user turn; `{question}` = the stripped question
    append_question_mark: bool = False  # `?` after a question that does not end with one (Search-R1's data)
    apply_chat_template: ChatTemplate = True  # "auto": when the tokenizer has one (Search-R1's rule)
    observation_template: str = OBSERVATION_TEMPLATE  # `{passages}` exactly once
    passage_template: str = PASSAGE_TEMPLATE
    strip_passages: bool = False  # strip the rendered passages' surrounding white space (Search-R1 does)
    observation_truncation: Truncation = "passages"  # cut the passages only, or the whole observation
    observation_max_tokens: int | None = None  # None: the gateway's --observation-max-tokens
    invalid_action_message: str = CORRECTIVE

    def __post_init__(self) -> None:
        why = (template_error("prompt_template", self.prompt_template, "question")
               or template_error("observation_template", self.observation_template, "passages", once=True))
        if why is not None:
            raise ValueError(why)
        if self.apply_chat_template not in (True, False, "auto"):
            raise ValueError(f"apply_chat_template={self.apply_chat_template!r}: expected true, false or 'auto'")
        if self.observation_truncation not in ("passages", "whole"):
            raise ValueError(f"observation_truncation={self.observation_truncation!r}: expected 'passages' or 'whole'")

    def question_text(self, question: str) -> str:
        """The question as the prompt holds it: stripped, and with `?` appended when `append_question_mark`."""
        text = question.strip()
        return text + "?" if self.append_question_mark and not text.endswith("?") else text

    def prompt_text(self, question: str) -> str:
        return fill(self.prompt_template, {"question": self.question_text(question)})
