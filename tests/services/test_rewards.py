"""Reward cases: SQuAD normalisation, several gold answers, no answer, answer taken from the response only."""

from __future__ import annotations

import pytest
from sisrl.services.rewards import (
    RewardSpec,
    exact_match,
    extract_answer,
    f1_score,
    normalize_answer,
    reward_spec,
    score_response,
)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("The  Eiffel Tower!", "eiffel tower"),
        ("an apple, a pear", "apple pear"),
        ("Theatre", "theatre"),  # 'the' only as a whole word
        ("  U.S.A.  ", "usa"),
        ("", ""),
    ],
)
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


def test_exact_match_any_gold() -> None:
    assert exact_match("eight", ["8", "Eight"]) == 1.0
    assert exact_match("8", ["eight", "8"]) == 1.0
    assert exact_match("nine", ["eight", "8"]) == 0.0


def test_f1_best_over_gold() -> None:
    # pred 'second battle' vs gold 'Second Battle of Bull Run': overlap 2, precision 2/2, recall 2/5 -> 4/7.
    assert f1_score("second battle", ["Second Battle of Bull Run", "x"]) == pytest.approx(4 / 7)
    assert f1_score("nothing", ["eight"]) == 0.0


def test_extract_answer_last_complete_tag() -> None:
    assert extract_answer("<answer> a </answer> then <answer>Paris</answer>") == "Paris"
    assert extract_answer("<answer>unterminated") is None
    assert extract_answer("no tags") is None


def test_score_no_answer_is_zero() -> None:
    result = score_response(turn_texts=["<think>hmm</think>"], valid_actions=0, golden_answers=["x"], spec=RewardSpec())
    assert (result.answer, result.reward, result.em, result.f1, result.format) == (None, 0.0, 0.0, 0.0, 0.0)


def test_score_em_and_format_weight() -> None:
    turns = ["<search>q</search>", "<answer>The Beatles</answer>"]
    plain = score_response(turn_texts=turns, valid_actions=2, golden_answers=["beatles"], spec=RewardSpec())
    assert (plain.answer, plain.reward, plain.em, plain.format) == ("The Beatles", 1.0, 1.0, 1.0)
    # Wrong answer, valid format, weight 0.2: reward = 0.8 * 0 + 0.2 * 1.
    wrong = score_response(
        turn_texts=turns, valid_actions=2, golden_answers=["stones"], spec=RewardSpec(format_weight=0.2)
    )
    assert wrong.reward == pytest.approx(0.2)
    # One invalid turn breaks the format score.
    bad = score_response(turn_texts=turns, valid_actions=1, golden_answers=["beatles"], spec=RewardSpec())
    assert bad.format == 0.0 and bad.em == 1.0


def test_reward_spec_per_source() -> None:
    assert reward_spec("nq").metric == "em"
    assert reward_spec("hotpotqa").metric == "em"
    with pytest.raises(ValueError, match="unknown data_source 'trivia'.*hotpotqa"):
        reward_spec("trivia")
    with pytest.raises(ValueError, match="metric"):
        RewardSpec(metric="bleu")
