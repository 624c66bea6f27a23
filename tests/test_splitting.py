"""Long replies split at natural boundaries, never truncated, code fences balanced per part."""

from __future__ import annotations

import random
import re

import pytest

from platforms.splitting import SplitMemo, split_parts, split_text, utf16_len
from platforms.telegram_format import to_html, visible_text


def test_short_text_is_one_part() -> None:
    assert split_text("hello", 10) == ["hello"]
    assert split_text("", 10) == []


def test_paragraph_boundaries_are_preferred_and_nothing_is_lost() -> None:
    text = "\n\n".join(f"paragraph {i} " + "word " * 30 for i in range(20))
    parts = split_text(text, 500)
    assert all(len(p) <= 500 for p in parts)
    assert all(p.startswith("paragraph") for p in parts)
    assert "".join(parts).replace("\n", "").replace(" ", "") == text.replace("\n", "").replace(" ", "")


def test_code_blocks_are_closed_and_reopened_with_their_language() -> None:
    code = "\n".join(f"print({i})" for i in range(400))
    text = f"Here you go:\n```python\n{code}\n```\nDone."
    parts = split_text(text, 1000)
    assert len(parts) > 3
    for part in parts:
        assert len(part) <= 1000
        assert part.count("```") % 2 == 0, part
    assert all(p.startswith("```python\n") for p in parts[1:])
    body = "".join(parts)
    assert all(f"print({i})" in body for i in range(400))


def test_telegram_lengths_count_utf16_code_units() -> None:
    text = "😀" * 3000  # each emoji is two UTF-16 code units
    parts = split_text(text, 4096, utf16_len)
    assert all(utf16_len(p) <= 4096 for p in parts)
    assert "".join(parts) == text


def test_a_single_long_word_is_cut_hard_rather_than_lost() -> None:
    text = "x" * 2500
    parts = split_text(text, 1000)
    assert len(parts) == 3 and all(len(p) <= 1000 for p in parts)
    assert "".join(parts) == text


def _markdown(seed: int, paragraphs: int) -> str:
    rnd = random.Random(seed)
    words = ["plain", "**bold**", "`code`", "*it*", "[a link](https://example.com/some/long/path)", "a&b", "<tag>",
             "😀", "word"]
    blocks = []
    for i in range(paragraphs):
        if rnd.random() < 0.15:
            blocks.append("```python\n" + "\n".join(f"x_{i}_{j} = {j}  # <{j}>" for j in range(rnd.randint(3, 60)))
                          + "\n```")
        else:
            blocks.append(" ".join(f"{rnd.choice(words)}{i}_{k}" for k in range(rnd.randint(5, 80))))
    return "\n\n".join(blocks)


def _visible(text: str) -> int:
    return utf16_len(visible_text(to_html(text)))


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_parts_fit_by_what_telegram_counts_and_nothing_is_lost(seed: int) -> None:
    text = _markdown(seed, 120)
    parts = split_parts(text, 4048, _visible, bound=utf16_len)
    assert len(parts) > 1, f"seed {seed}"
    assert all(_visible(p.text) <= 4048 for p in parts), f"seed {seed}"
    tokens = re.findall(r"\w+_\d+", text)
    assert [t for p in parts for t in re.findall(r"\w+_\d+", p.text)] == tokens, f"seed {seed}"
    assert all(text[p.start:p.end] in p.text for p in parts), f"seed {seed}: spans"
    # Visible text can be far shorter than its source: parts are filled by what is counted.
    assert max(_visible(p.text) for p in parts) > 3500, f"seed {seed}"


@pytest.mark.parametrize("seed", [5, 6])
def test_a_memo_splits_a_growing_text_exactly_as_a_fresh_split_does(seed: int) -> None:
    text = _markdown(seed, 60)
    memo = SplitMemo()
    rnd = random.Random(seed)
    n = 0
    while n < len(text):
        n = min(len(text), n + rnd.randint(200, 2500))
        grown = text[:n]
        assert split_parts(grown, 4048, _visible, bound=utf16_len, memo=memo) == \
            split_parts(grown, 4048, _visible, bound=utf16_len), f"seed {seed}, at {n}"
