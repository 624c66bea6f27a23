"""Markdown → Telegram HTML, checked against the fake Bot API's parser (which mirrors Telegram's)."""

from __future__ import annotations

import random

import pytest

from platforms.splitting import split_text, utf16_len
from platforms.telegram_format import to_html, visible_text
from platforms.telegram_intake import strip_spans as _strip_spans
from tests.fakes.telegram_html import parse_html


@pytest.mark.parametrize(("markdown", "text", "entities"), [
    ("**bold** and *it* or _it_", "bold and it or it",
     [("bold", 0, 4), ("italic", 9, 2), ("italic", 15, 2)]),
    ("snake_case_name, 2*3*4 and __init__", "snake_case_name, 2*3*4 and __init__", []),
    ("a < b && c > d", "a < b && c > d", []),
    ("use `x<y>` here", "use x<y> here", [("code", 4, 4)]),
    ("## Heading\nbody", "Heading\nbody", [("bold", 0, 7)]),
    ("see [docs](https://example.com/a?b=1&c=2)", "see docs", [("text_link", 4, 4)]),
    ("[not a link](javascript:alert(1))", "[not a link](javascript:alert(1))", []),
    ("~~old~~ ***both***", "old both", [("strikethrough", 0, 3), ("bold", 4, 4), ("italic", 4, 4)]),
    ("**unclosed and *dangling", "**unclosed and *dangling", []),
    ("**bold `code` inside**", "bold code inside", [("bold", 0, 16)]),  # no code inside bold
    ("😀 **x**", "😀 x", [("bold", 3, 1)]),  # UTF-16 offsets
])
def test_inline_markdown(markdown: str, text: str, entities: list[tuple[str, int, int]]) -> None:
    got_text, got = parse_html(to_html(markdown))
    assert got_text == text
    assert [(e["type"], e["offset"], e["length"]) for e in got] == entities


def test_code_blocks_keep_their_language_and_escape_everything() -> None:
    md = "Look:\n```python\nif a < b and c > d: print('&')\n```\nDone **now**"
    text, entities = parse_html(to_html(md))
    assert text == "Look:\nif a < b and c > d: print('&')\nDone now"
    assert entities[0] == {"type": "pre", "offset": 6, "length": 30, "language": "python"}
    assert entities[1]["type"] == "bold"


def test_an_unclosed_fence_mid_stream_renders_as_code() -> None:
    text, entities = parse_html(to_html("Here:\n```js\nlet x = **1**;"))
    assert text == "Here:\nlet x = **1**;"
    assert entities == [{"type": "pre", "offset": 6, "length": 14, "language": "js"}]


def test_split_parts_each_render_with_balanced_code_blocks() -> None:
    body = "\n".join(f"line {i} <&>" for i in range(400))
    md = "intro\n\n```sh\n" + body + "\n```\n\n**end**"
    parts = split_text(md, 1000, utf16_len)
    assert len(parts) > 3
    for part in parts:
        text, _entities = parse_html(to_html(part))
        assert utf16_len(text) <= 1000


def test_random_markdown_always_parses() -> None:
    rng = random.Random(1234)
    atoms = ["*", "**", "_", "__", "~~", "`", "```", "```py\n", "\n", " ", "#", "## ", "[", "]", "(", ")",
             "https://x.y", "<", ">", "&", "&amp;", "word", "😀", '"', "'", "\\", "-"]
    for _ in range(3000):
        md = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 40)))
        rendered = to_html(md)
        text, _entities = parse_html(rendered)  # raises HtmlParseError if Telegram would reject it
        assert text == visible_text(rendered)
        assert utf16_len(text) <= utf16_len(md)  # rendering never makes a part longer


@pytest.mark.parametrize(("text", "spans", "out"), [
    ("@bot hello", [(0, 4)], "hello"),
    ("@bot, what now", [(0, 4)], "what now"),
    ("hey @bot how are you", [(4, 4)], "hey how are you"),
    ("😀 @bot x", [(3, 4)], "😀 x"),  # offsets count UTF-16 units
    ("ask @bot", [(4, 4)], "ask"),
])
def test_mentions_are_stripped_by_utf16_span(text: str, spans: list[tuple[int, int]], out: str) -> None:
    assert _strip_spans(text, spans) == out
