"""A small real disk for disk-full tests: a tmpfs mounted for the test (which needs root), and a
file that takes every free byte of it."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


class MountFailed(RuntimeError):
    """The tmpfs could not be mounted (mounting one needs root)."""


def mount_tmpfs(mount: Path, *, size: str = "8m", owner: tuple[int, int] | None = None) -> Path:
    """Mount a tmpfs of `size` on `mount` (owned by `owner`'s uid and gid, if given); see `unmount`."""
    mount.mkdir(exist_ok=True)
    options = f"size={size},mode=0700" + (f",uid={owner[0]},gid={owner[1]}" if owner else "")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    if made.returncode != 0:
        raise MountFailed(f"the disk-full tests mount a small tmpfs, which needs root: {made.stderr.strip()}")
    return mount


def unmount(mount: Path) -> None:
    subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)


@contextlib.contextmanager
def small_tmpfs(mount: Path, *, size: str = "8m", owner: tuple[int, int] | None = None) -> Iterator[Path]:
    """`mount` as a tmpfs of `size` (owned by `owner`'s uid and gid, if given), unmounted at the end."""
    try:
        mount_tmpfs(mount, size=size, owner=owner)
    except MountFailed as exc:
        pytest.fail(str(exc))
    try:
        yield mount
    finally:
        unmount(mount)


def fill(disk: Path) -> Path:
    """Take every free byte of `disk`; the file that holds them (delete it to give them back)."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)

        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 512)

    stat = os.statvfs(disk)
    assert stat.f_bavail * stat.f_frsize < 65536, "the disk is not full"
    return filler
