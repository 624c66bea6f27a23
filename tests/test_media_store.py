"""The local copies of attachments: what a replay reads instead of downloading, and their retention."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from pathlib import Path

from gateway.core.attachments import Attachment, MediaSettings
from platforms.media import MediaStore, inline_text

PNG = b"\x89PNG\r\n\x1a\n" + bytes(64)


def _inline(data: bytes, name: str = "pasted.png") -> Attachment:
    return Attachment("image", name, "image/png", len(data), f"sha256:{hashlib.sha256(data).hexdigest()}", data=data)


async def test_inline_data_is_kept_for_a_replay_and_never_fetched_by_its_hash(tmp_path: Path) -> None:
    store = MediaStore(MediaSettings(), tmp_path / "media", {})
    att = _inline(PNG)
    (part,) = await store.load("api", [att])
    assert part.kind == "image" and part.data == PNG and part.mime == "image/png"
    assert store.path_for("api", att).read_bytes() == PNG
    # After a restart the message comes back from the store without its bytes: the copy serves it.
    replayed = Attachment.from_dict(att.to_dict())
    assert replayed.data is None
    (again,) = await store.load("api", [replayed])
    assert again.data == PNG and store.downloads == 0
    # Without a copy, a hash is not something to download: the model and the user are told.
    lost = dataclasses.replace(replayed, ref="sha256:" + "0" * 64)
    (note,) = await store.load("api", [lost])
    assert note.kind == "note" and note.problem == "it is no longer available"


async def test_a_copy_over_the_limit_is_not_trusted(tmp_path: Path) -> None:
    settings = MediaSettings(max_image_bytes=100)
    store = MediaStore(settings, tmp_path / "media", {})
    att = dataclasses.replace(_inline(PNG), data=None)
    path = store.path_for("api", att)
    path.parent.mkdir(parents=True)
    path.write_bytes(PNG + bytes(200))  # e.g. written under an older, larger limit
    (note,) = await store.load("api", [att])
    assert note.kind == "note"


def test_copies_older_than_the_retention_are_deleted(tmp_path: Path) -> None:
    directory = tmp_path / "media"
    directory.mkdir()
    old, fresh = directory / "old", directory / "fresh"
    old.write_bytes(b"x")
    fresh.write_bytes(b"y")
    two_days_ago = time.time() - 48 * 3600
    os.utime(old, (two_days_ago, two_days_ago))
    assert MediaStore(MediaSettings(retention_hours=0), directory, {}).prune() == 0  # 0 keeps everything
    assert MediaStore(MediaSettings(retention_hours=24), directory, {}).prune() == 1
    assert sorted(p.name for p in directory.iterdir()) == ["fresh"]


def test_a_text_file_is_fenced_cut_to_its_budget_and_binary_is_refused() -> None:
    att = Attachment("file", "notes.md", "text/markdown", None, "x")
    part = inline_text(att, b"```py\nprint(1)\n```\n" + b"a" * 100, budget=30)
    assert part.text.startswith("File notes.md (text/markdown, 119 B):\n````\n```py\nprint(1)\n```\n")
    assert part.text.endswith("\n````\n[… cut: the first 30 of 119 characters]")
    assert inline_text(att, b"\x00\x01binary", budget=30).problem == "it is a binary file, not text"
    assert inline_text(att, b"\xff\xfe\xfa", budget=30).problem == "it is not UTF-8 text"
