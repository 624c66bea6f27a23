"""Long replies split at natural boundaries, never truncated, code fences balanced per part."""

from __future__ import annotations

from platforms.splitting import split_text, utf16_len


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
