"""Model Markdown rendered to Telegram's HTML parse mode.

Handles what models actually write: **bold**, *italic*/_italic_, ~~strike~~, `code`, fenced
blocks with a language, [links](https://…) and # headings (shown bold). Everything else is
escaped, so the output always parses; an unmatched marker (mid-stream, say) stays literal and
an unclosed fence renders as a code block up to the end of the text.
"""

from __future__ import annotations

import html
import re

# An opening fence line, its body, and the closing fence line (or the end of a partial text).
_FENCE = re.compile(r"^ {0,3}```([^\n`]*)\n(.*?)(?:^ {0,3}```[ \t]*$|\Z)", re.M | re.S)
_LANGUAGE = re.compile(r"[\w#+.-]{1,32}")
_TAG = re.compile(r"<[^>]*>")

# Alternatives are tried at the leftmost position in this order, so `code` beats emphasis.
_INLINE = re.compile(
    r"(?P<code>(?<!`)(?P<ticks>`+)(?!`)(?P<code_body>[^\n]+?)(?<!`)(?P=ticks)(?!`))"
    r"|(?P<link>\[(?P<link_text>[^\[\]\n]+)\]\((?P<url>(?:https?://|mailto:|tg://)[^\s()<>]+)\))"
    r"|(?P<heading>^\#{1,6}[ \t]+(?P<heading_body>[^\n]+?)[ \t#]*$)"
    r"|(?P<bolditalic>\*\*\*(?=\S)(?P<bolditalic_body>[^\n]+?)(?<=\S)\*\*\*)"
    r"|(?P<bold>\*\*(?=\S)(?P<bold_body>[^\n]+?)(?<=\S)\*\*)"
    r"|(?P<strike>~~(?=\S)(?P<strike_body>[^\n]+?)(?<=\S)~~)"
    r"|(?P<italic>(?<![\w*])\*(?=[^\s*])(?P<italic_body>[^\n]+?)(?<=[^\s*])\*(?![\w*]))"
    r"|(?P<italic2>(?<![\w_])_(?=[^\s_])(?P<italic2_body>[^\n]+?)(?<=[^\s_])_(?![\w_]))",
    re.M,
)
# Formatting alternatives and the tags they open, outermost first.
_WRAP = {"heading": ("b",), "bolditalic": ("b", "i"), "bold": ("b",), "strike": ("s",), "italic": ("i",),
         "italic2": ("i",)}


def escape(text: str) -> str:
    return html.escape(text, quote=False)


def to_html(text: str) -> str:
    """Render one message part (already split to the platform limit) as Telegram HTML."""
    out: list[str] = []
    pos = 0
    for m in _FENCE.finditer(text):
        out.append(_inline(text[pos:m.start()]))
        out.append(_pre(m.group(2).removesuffix("\n"), m.group(1).strip()))
        pos = m.end()
    out.append(_inline(text[pos:]))
    return "".join(out)


def visible_text(rendered: str) -> str:
    """What Telegram would show for `rendered` HTML (to avoid sending an empty message)."""
    return html.unescape(_TAG.sub("", rendered))


def _pre(body: str, info: str) -> str:
    language = info.split()[0] if info else ""
    if _LANGUAGE.fullmatch(language):
        return f'<pre><code class="language-{language}">{escape(body)}</code></pre>'
    return f"<pre>{escape(body)}</pre>"


def _inline(text: str, *, nested: bool = False, in_link: bool = False) -> str:
    """Inline Markdown to HTML. Telegram lets formatting contain links but not code, and
    links contain neither code nor links, so those stay plain text when nested."""
    out: list[str] = []
    pos = 0
    while pos < len(text):
        m = _INLINE.search(text, pos)
        if m is None:
            break
        out.append(escape(text[pos:m.start()]))
        kind = _kind(m)
        if kind == "code":
            body = escape(m.group("code_body").strip() or m.group("code_body"))
            out.append(body if nested else f"<code>{body}</code>")
        elif kind == "link":
            label = _inline(m.group("link_text"), nested=True, in_link=True)
            url = html.escape(m.group("url"), quote=True)
            out.append(label if in_link else f'<a href="{url}">{label}</a>')
        elif kind == "heading" and nested:  # a "#" line inside emphasis: just its text
            out.append(_inline(m.group("heading_body"), nested=True, in_link=in_link))
        else:
            tags = _WRAP[kind]
            inner = _inline(m.group(f"{kind}_body"), nested=True, in_link=in_link)
            out.append("".join(f"<{t}>" for t in tags) + inner + "".join(f"</{t}>" for t in reversed(tags)))
        pos = m.end()
    out.append(escape(text[pos:]))
    return "".join(out)


def _kind(m: re.Match[str]) -> str:
    """The outer alternative that matched."""
    for name in ("code", "link", *_WRAP):
        if m.group(name) is not None:
            return name
    raise AssertionError("no alternative matched")  # pragma: no cover
