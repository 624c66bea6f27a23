"""Telegram "HTML" parse_mode, rendered to (text, entities) the way the Bot API does (roughly)."""

from __future__ import annotations

import re
from typing import Any

TAG_ENTITY = {
    "b": "bold", "strong": "bold", "i": "italic", "em": "italic",
    "u": "underline", "ins": "underline", "s": "strikethrough", "strike": "strikethrough",
    "del": "strikethrough", "a": "text_link", "code": "code", "pre": "pre",
    "tg-spoiler": "spoiler", "span": "spoiler", "blockquote": "blockquote",
    "tg-emoji": "custom_emoji",
}  # fmt: skip
ALLOWED_TAGS = frozenset(TAG_ENTITY)
_NAME_RE = re.compile(r"[a-zA-Z][\w-]*")
_ATTR_RE = re.compile(r"""([a-zA-Z][\w-]*)(?:\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+)))?""")
_CHAR_REF_RE = re.compile(r"&(#x[0-9a-fA-F]+|#[0-9]+|lt|gt|amp|quot);")
_NAMED_REFS = {"lt": "<", "gt": ">", "amp": "&", "quot": '"'}


class HtmlParseError(ValueError):
    """Telegram's "can't parse entities" reason (without the "Bad Request: ..." prefix)."""


def utf16_len(text: str) -> int:
    """Length in UTF-16 code units, as Telegram counts offsets and limits."""
    return len(text.encode("utf-16-le")) // 2


def _start_entity(name: str, body: str, pos: int, where: str) -> dict[str, Any]:
    attrs = {
        a.group(1).lower(): next((g for g in a.group(2, 3, 4) if g is not None), "")
        for a in _ATTR_RE.finditer(body[len(name) :])
    }
    ent: dict[str, Any] = {"type": TAG_ENTITY[name], "offset": pos, "length": 0}
    if name == "a":
        ent["url"] = attrs.get("href", "")
    elif name == "span" and attrs.get("class") != "tg-spoiler":
        raise HtmlParseError(f'Tag "span" must have class "tg-spoiler" {where}')
    elif name == "tg-emoji":
        if "emoji-id" not in attrs:
            raise HtmlParseError(f"Custom emoji entity must contain a tg://emoji URL {where}")
        ent["custom_emoji_id"] = attrs["emoji-id"]
    elif name == "blockquote" and "expandable" in attrs:
        ent["type"] = "expandable_blockquote"
    elif name == "code" and attrs.get("class", "").startswith("language-"):
        ent["_language"] = attrs["class"][len("language-") :]
    return ent


def parse_html(src: str) -> tuple[str, list[dict[str, Any]]]:
    """Render Telegram-HTML into (plain text, entities); raise HtmlParseError like Telegram.

    Only tags from Telegram's allowed set are accepted and they must nest properly; `&lt;`,
    `&gt;`, `&amp;`, `&quot;` and numeric references are decoded. Offsets are UTF-16 units.
    """
    out: list[str] = []
    pos = 0
    stack: list[tuple[str, dict[str, Any]]] = []
    entities: list[dict[str, Any]] = []
    i = 0
    while i < len(src):
        if src[i] == "<":
            where = f"at byte offset {len(src[:i].encode())}"
            end = src.find(">", i)
            if end < 0:
                raise HtmlParseError(f"Unclosed start tag {where}")
            body, i = src[i + 1 : end].strip(), end + 1
            if body.startswith("/"):
                if not stack:
                    raise HtmlParseError(f"Unexpected end tag {where}")
                name, ent = stack.pop()
                if body[1:].strip().lower() != name:
                    raise HtmlParseError(f'Can\'t find end tag corresponding to start tag "{name}"')
                ent["length"] = pos - ent["offset"]
                lang = ent.pop("_language", None)
                if lang and stack and stack[-1][0] == "pre":  # <pre><code class="language-x">
                    stack[-1][1]["language"], ent["length"] = lang, 0
                continue
            m = _NAME_RE.match(body)
            name = m.group(0).lower() if m else ""
            if name not in ALLOWED_TAGS:
                raise HtmlParseError(f'Unsupported start tag "{name}" {where}')
            ent = _start_entity(name, body, pos, where)
            entities.append(ent)
            stack.append((name, ent))
            continue
        if src[i] == "&" and (ref := _CHAR_REF_RE.match(src, i)):
            code = ref.group(1)
            if code.startswith("#"):
                chunk = chr(int(code[2:], 16) if code[1] in "xX" else int(code[1:]))
            else:
                chunk = _NAMED_REFS[code]
            i = ref.end()
        else:
            j = min((k for k in (src.find("<", i + 1), src.find("&", i + 1)) if k >= 0), default=len(src))
            chunk, i = src[i:j], j
        out.append(chunk)
        pos += utf16_len(chunk)
    if stack:
        raise HtmlParseError(f'Can\'t find end tag corresponding to start tag "{stack[-1][0]}"')
    return "".join(out), [e for e in entities if e["length"] > 0]
