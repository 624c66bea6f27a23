"""Images and files through the OpenAI-compatible HTTP API (content parts with data: URLs), and
what an image costs in the context budget."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import aiohttp

from gateway.core.attachments import Attachment, MediaPart
from gateway.core.context import IMAGE_TOKENS, fit, message_tokens
from gateway.core.transcript import ChatMessage
from tests.conftest import DaemonFactory
from tests.fakes.openai_provider import FakeProvider

KEY = "sk-test-media"
GIF = b"GIF89a" + bytes(range(100))


def _url(daemon: Any) -> str:
    return f"http://127.0.0.1:{daemon.config.http.port}/v1/chat/completions"


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _data(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


async def _post(http: aiohttp.ClientSession, daemon: Any, messages: list[dict[str, Any]],
                **extra: Any) -> tuple[int, dict[str, Any]]:
    async with http.post(_url(daemon), json={"model": "switchboard", "messages": messages, **extra},
                         headers={"Authorization": f"Bearer {KEY}"}) as resp:
        return resp.status, await resp.json()


async def test_image_url_parts_with_data_urls_reach_the_model(make_daemon: DaemonFactory,
                                                              provider: FakeProvider) -> None:
    provider.words = 1
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]}, agent={"vision": True})
    url = _data(GIF, "image/gif")
    doc = {"type": "file", "file": {"filename": "todo.md", "file_data": _data(b"- [ ] ship it\n", "text/markdown")}}
    async with aiohttp.ClientSession() as http:
        status, out = await _post(http, daemon, [
            {"role": "user", "content": [{"type": "text", "text": "look"}, _image(url)]},
            {"role": "assistant", "content": "a gif"},
            {"role": "user", "content": [{"type": "text", "text": "and these?"}, _image(url), doc]}])
    assert status == 200, out
    assert out["choices"][0]["message"]["content"] == "reply to: and these?\n[image: image_2.gif, 106 B]\n" \
                                                     "[file: todo.md, 14 B] w0 "
    body = provider.connections[-1].body
    parts = body["messages"][-1]["content"]
    assert parts[1] == _image(url)  # sent on as it came, as a vision content part
    assert parts[2]["text"].startswith("File todo.md (text/markdown, 14 B):\n```\n- [ ] ship it\n")
    # An earlier message's image is not sent again: a placeholder stands for it.
    assert body["messages"][0] == {"role": "user", "content": "look\n[image sent earlier]"}


async def test_bad_image_parts_are_refused_with_400(make_daemon: DaemonFactory, provider: FakeProvider) -> None:
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]}, agent={"vision": True},
                               media={"max_image_bytes": 1000, "max_file_bytes": 1000})
    cases = {
        "not base64": "data:image/png;base64,@@@not-base64@@@",
        "no base64 marker": "data:image/png,rawbytes",
        "a remote URL": "https://example.com/cat.png",
        "not an image": _data(b"hello", "text/plain"),
        "too big": _data(b"\x89PNG\r\n\x1a\n" + bytes(5000), "image/png"),
        "empty": "data:image/png;base64,",
    }
    async with aiohttp.ClientSession() as http:
        for what, url in cases.items():
            status, out = await _post(http, daemon, [{"role": "user", "content": [_image(url)]}])
            assert status == 400, (what, out)
            assert out["error"]["type"] == "invalid_request_error" and out["error"]["param"] == "messages", what
        status, out = await _post(http, daemon, [{"role": "user", "content": [{"type": "audio", "data": "x"}]}])
        assert status == 400 and "text, image_url or file part" in out["error"]["message"]
        # A real image that is not a supported type: refused by the router, with its reason.
        status, out = await _post(http, daemon, [{"role": "user", "content": [
            _image(_data(b"BM" + bytes(100), "image/bmp"))]}])
        assert status == 400 and out["error"]["message"] == \
            "I could not read image_1.img: image/bmp images are not supported."
    assert provider.connections == []


async def test_with_vision_off_an_image_is_refused_and_said(make_daemon: DaemonFactory,
                                                            provider: FakeProvider) -> None:
    daemon = await make_daemon(api={"enabled": True, "keys": [KEY]})
    async with aiohttp.ClientSession() as http:
        status, out = await _post(http, daemon, [{"role": "user", "content": [_image(_data(GIF, "image/gif"))]}])
    assert status == 400
    assert out["error"]["message"] == "I could not read image_1.gif: this model cannot see images."


def test_an_image_costs_a_fixed_number_of_tokens_not_its_base64() -> None:
    att = Attachment("image", "big.png", "image/png", 5_000_000, "sha256:x")
    image = MediaPart("image", att, data=b"\x89PNG" + bytes(5_000_000), mime="image/png")
    plain = ChatMessage("user", "what is this?")
    with_image = ChatMessage("user", "what is this?", media=(image,))
    assert message_tokens(with_image) - message_tokens(plain) == IMAGE_TOKENS + 4
    configured = ChatMessage("user", "x", media=(MediaPart("image", att, data=b"", mime="image/png", tokens=85),))
    assert message_tokens(configured) - message_tokens(ChatMessage("user", "x")) == 85 + 4
    # A 5 MB image does not push the conversation out of a small window.
    history = [ChatMessage("user", "earlier question"), ChatMessage("assistant", "earlier answer")]
    fitted = fit(history, with_image, budget_tokens=2_000)
    assert fitted.left_out == 0 and fitted.estimated_tokens < 2_000
    assert json.dumps(with_image.to_openai()).count("base64") == 1


async def test_the_web_chat_sends_pasted_images_and_files_as_parts(make_daemon: DaemonFactory,
                                                                    provider: FakeProvider) -> None:
    provider.delay_s, provider.words = 0.0, 1
    daemon = await make_daemon(agent={"vision": True}, media={"max_image_bytes": 1000, "max_file_bytes": 1000})
    base = f"http://127.0.0.1:{daemon.config.http.port}"
    pasted = {"type": "file", "file": {"filename": "screen.gif", "file_data": _data(GIF, "image/gif")}}
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.get(base + "/") as resp:
            assert resp.status == 200
        ws = await http.ws_connect(base + "/ws", origin=base)
        assert (await ws.receive_json())["type"] == "hello"

        async def until(pred: Any) -> list[dict[str, Any]]:
            seen: list[dict[str, Any]] = []
            async with asyncio.timeout(5):
                while not seen or not pred(seen[-1]):
                    seen.append(await ws.receive_json())
            return seen

        await ws.send_json({"type": "message", "id": "m1", "text": "", "parts": [pasted]})
        frames = await until(lambda f: f == {"type": "state", "running": False})
        assert [f["text"] for f in frames if f["type"] == "edit"][-1] == "reply to: [image: screen.gif, 106 B] w0 "
        assert provider.connections[-1].last_user_parts[1] == _image(_data(GIF, "image/gif"))
        # Too big to even decode: refused for good (acknowledged), with the reason.
        big = {"type": "file", "file": {"filename": "big.gif", "file_data": _data(GIF + bytes(2000), "image/gif")}}
        await ws.send_json({"type": "message", "id": "m2", "text": "and this", "parts": [big]})
        frames = await until(lambda f: f["type"] == "ack")
        assert frames[-1] == {"type": "ack", "id": "m2", "outcome": "rejected"}
        assert frames[0]["text"] == "That attachment part 0: the data URL is larger than 1000 bytes."
        hello = await (await http.ws_connect(base + "/ws", origin=base)).receive_json()
        assert [r["text"] for r in hello["history"] if r["role"] == "user"] == ["[image: screen.gif, 106 B]"]
        await ws.close()
    assert len(provider.connections) == 1
