"""The streaming engine's bookkeeping on its own: which message shows which part, and what a
refused or deleted message does to the rest of the reply."""

from __future__ import annotations

from platforms.reply_parts import Change, ReplyParts, ShownMessage, change_for


def test_a_message_is_edited_only_when_what_it_shows_changes() -> None:
    shown = ShownMessage("1", "hello", 5, stop="stop:t:u")
    assert change_for(None, "hello", None, can_edit=True) is Change.SEND
    assert change_for(shown, "hello", "stop:t:u", can_edit=True) is Change.SAME
    assert change_for(shown, "hello", None, can_edit=True) is Change.EDIT  # the final state drops the button
    assert change_for(shown, "hello there", "stop:t:u", can_edit=False) is Change.STUCK
    plain = ShownMessage("2", "hello", 5)
    # Shown without a button (sent final, or its button removed): not edited just to add one.
    assert change_for(plain, "hello", "stop:t:u", can_edit=True) is Change.SAME


def test_a_refused_part_is_split_smaller_down_to_the_least_size_then_given_up() -> None:
    parts = ReplyParts(1000, len, None, min_limit=256)
    parts.text = "word " * 400
    assert parts.limit == 1000 - 48  # room for a stop mark
    first = next(parts.parts())
    assert parts.split_smaller(first, 0) and parts.limit == 476
    assert parts.split_smaller(first, 0) and parts.limit == 256
    assert not parts.split_smaller(first, 0)  # as small as it goes: the caller gives it up
    refused = next(parts.parts())
    parts.give_up(refused, 0)
    after = next(parts.parts())
    assert after.start >= refused.end and parts.text[after.start:after.end].strip() == after.text.strip()
    assert parts.shown() == ""  # nothing was sent


def test_after_a_deleted_message_the_rest_continues_in_a_new_one_inside_its_code_block() -> None:
    parts = ReplyParts(200, len, None, min_limit=64)
    parts.text = "```py\n" + "".join(f"x = {i}\n" for i in range(40)) + "```\nafter"
    first = next(parts.parts())
    parts.add(ShownMessage("m1", first.text, first.end))
    parts.deleted(0)
    rest = next(parts.parts())
    assert rest.start == first.end and rest.text.startswith("```py\n")  # the block is reopened
    assert parts.message(0) is None  # the deleted one is out of the window
    assert parts.shown() == parts.text[:first.end]  # it was seen, though
    last = parts.last()
    assert last is not None and last.gone


def test_the_final_text_keeps_what_frozen_messages_show() -> None:
    parts = ReplyParts(200, len, None, min_limit=64)
    assert parts.final("  ") == "(no answer)"
    parts.text = "a" * 150 + " " + "b" * 150
    first = next(parts.parts())
    parts.add(ShownMessage("m1", first.text, first.end))
    parts.deleted(0)
    streamed = parts.text
    assert parts.final("b" * 150) == streamed  # the answer's end, already shown: unchanged
    assert parts.final("something else") == streamed[:first.end] + "something else"
