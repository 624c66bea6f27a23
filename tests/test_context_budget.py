"""The context budget: what of a long conversation is sent, and what never is split."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from typing import Any

from gateway.core.attachments import Attachment, MediaPart
from gateway.core.context import SHORTENED, HistoryMemo, encode, estimate, fit, message_tokens
from gateway.core.transcript import ChatMessage, ToolCall


def turn(i: int, *, tool_output: str | None = None, interrupted: bool = False) -> list[ChatMessage]:
    rows = [ChatMessage("user", f"question {i} " + "x" * 200)]
    if tool_output is not None:
        call = ToolCall(f"c{i}", "shell", '{"command": "ls"}')
        rows += [ChatMessage("assistant", "", tool_calls=(call,)),
                 ChatMessage("tool", tool_output, tool_call_id=call.id)]
    rows.append(ChatMessage("assistant", f"answer {i} " + "y" * 200,
                            interrupted_by="user" if interrupted else None, reason="x" if interrupted else None))
    return rows


def history(n: int, **kw: object) -> list[ChatMessage]:
    return [m for i in range(n) for m in turn(i, **kw)]  # type: ignore[arg-type]


NEW = ChatMessage("user", "and now?")


def test_everything_is_sent_while_it_fits() -> None:
    h = history(5)
    fitted = fit(h, NEW, budget_tokens=32_000, system_prompt="be brief")
    assert fitted.messages == h and fitted.left_out == 0 and fitted.shortened == 0
    assert fitted.estimated_tokens == sum(message_tokens(m) + 1 for m in h) + message_tokens(NEW) + 1 + \
        estimate("be brief") + 4


def test_the_oldest_whole_turns_are_left_out_first_and_the_newest_always_go() -> None:
    h = history(500)  # 500 turns, ~120 tokens each: far over a 4,000 token window
    fitted = fit(h, NEW, budget_tokens=4_000)
    assert fitted.estimated_tokens <= 4_000
    assert fitted.messages == h[-len(fitted.messages):]  # a suffix of the history...
    assert fitted.messages[0].role == "user"  # ...that starts at a turn
    assert fitted.left_out == len(h) - len(fitted.messages) > 900


def test_old_tool_outputs_are_shortened_before_turns_are_dropped_and_pairs_never_split() -> None:
    h = history(30, tool_output="line of output\n" * 300)  # ~1,100 tokens of tool output each
    fitted = fit(h, NEW, budget_tokens=6_000)
    assert fitted.shortened > 0 and fitted.estimated_tokens <= 6_000
    newest = fitted.messages[-4:]
    assert newest == h[-4:]  # the most recent turn goes whole
    assert any(SHORTENED in m.content for m in fitted.messages if m.role == "tool")
    ids = [m.tool_call_id for m in fitted.messages if m.role == "tool"]
    calls = [c.id for m in fitted.messages for c in m.tool_calls]
    assert ids == calls  # every call sent has its result, every result its call


def test_an_interrupted_turn_is_kept_or_left_out_with_its_marker() -> None:
    h = history(40, interrupted=True)
    fitted = fit(h, NEW, budget_tokens=2_000)
    assert fitted.messages[0].role == "user" and fitted.messages[-1].interrupted_by == "user"


def test_the_provider_correction_ratio_tightens_the_cut() -> None:
    h = history(100)
    plain = fit(h, NEW, budget_tokens=5_000)
    corrected = fit(h, NEW, budget_tokens=5_000, ratio=2.0)  # the provider counted twice our estimate
    assert len(corrected.messages) < len(plain.messages)


def test_non_latin_text_counts_more_tokens_per_character() -> None:
    assert estimate("привет мир " * 10) > estimate("hello world " * 10)


class Spy(Sequence[ChatMessage]):
    """A history that records the oldest message anything looked at."""

    def __init__(self, rows: list[ChatMessage]) -> None:
        self.rows = rows
        self.lowest = len(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: Any) -> Any:
        start = index.start if isinstance(index, slice) else index
        self.lowest = min(self.lowest, start or 0)
        return self.rows[index]


def test_fitting_reads_only_what_is_sent_not_the_whole_conversation() -> None:
    spy = Spy(history(5_000))  # 20,000 messages
    fitted = fit(spy, NEW, budget_tokens=4_000)
    assert spy.lowest >= len(spy) - len(fitted.messages) - 4  # at most one turn beyond the cut


def random_turn(rng: random.Random, i: int) -> list[ChatMessage]:
    words = ["word", "слово", "字", "x" * 50, "tool", "🙂", "\"quoted\"", "line\nbreak"]

    def text(most: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(0, most)))

    media: tuple[MediaPart, ...] = ()
    if rng.random() < 0.15:  # an image or a file's text: encoded when sent, not kept by the memo
        seen = Attachment("image", "photo.png", "image/png", 12, f"ref{i}")
        media = (MediaPart("image", seen, data=rng.randbytes(12), mime="image/png"),
                 MediaPart("text", Attachment("file", "a.txt", "text/plain", 5, f"f{i}"), text=text(20)))
    rows = [ChatMessage("user", f"q{i} " + text(60), media=media)]
    for r in range(rng.choice([0, 0, 1, 2])):
        call = ToolCall(f"c{i}.{r}", "shell", json.dumps({"command": text(5)}))
        rows += [ChatMessage("assistant", text(5), tool_calls=(call,)),
                 ChatMessage("tool", text(rng.choice([10, 400])), tool_call_id=call.id)]
    interrupted = rng.random() < 0.1
    rows.append(ChatMessage("assistant", text(80), interrupted_by="user" if interrupted else None,
                            reason="stop" if interrupted else None))
    return rows


def test_the_memo_cuts_exactly_where_the_plain_computation_does() -> None:
    seed = int(os.environ.get("MEMO_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    for _history in range(30):
        memo = HistoryMemo()
        rows: list[ChatMessage] = []
        if rng.random() < 0.2:  # a history that does not start with a user row
            rows.append(ChatMessage("assistant", "resumed"))
        for step in range(40):
            rows += random_turn(rng, step)
            if rng.random() < 0.05:  # a /new: another history, which the memo must not take for this one
                rows = random_turn(rng, step)
            snapshot = list(rows)  # each turn sees a copy, as the turn runner hands it
            budget = rng.choice([200, 1_000, 3_000, 8_000, 30_000])
            ratio = rng.choice([1.0, rng.uniform(0.25, 4.0)])
            system = rng.choice([None, "be brief"])
            plain = fit(snapshot, NEW, budget_tokens=budget, system_prompt=system, ratio=ratio)
            memoed = fit(snapshot, NEW, budget_tokens=budget, system_prompt=system, ratio=ratio, memo=memo)
            where = f"seed {seed} (MEMO_SEED), step {step}, budget {budget}, ratio {ratio}"
            assert (memoed.messages, memoed.estimated_tokens, memoed.left_out, memoed.shortened) == \
                (plain.messages, plain.estimated_tokens, plain.left_out, plain.shortened), where
            assert memoed.encoded == b",".join(encode(m) for m in plain.messages), where
            assert json.loads(b"[" + (memoed.encoded or b"") + b"]") == [m.to_openai() for m in plain.messages]


def test_the_memo_reads_a_history_again_when_it_is_not_the_one_it_saw() -> None:
    memo = HistoryMemo()
    first = history(3)
    fit(first, NEW, budget_tokens=32_000, memo=memo)
    other = [*first[:-1], ChatMessage("assistant", "a different answer")]  # the same length, its end replaced
    fitted = fit(other, NEW, budget_tokens=32_000, memo=memo)
    assert fitted.messages == other and b"a different answer" in (fitted.encoded or b"")
    shorter = fit(first[:2], NEW, budget_tokens=32_000, memo=memo)
    assert shorter.messages == first[:2]
