"""Record which paths `os.fsync` is called on (the real fsync still runs), for the durability tests."""

from __future__ import annotations

import os

import pytest


def record_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, append the path of every fsynced descriptor (file or directory, as it is named at that
    moment, from /proc/self/fd) to the returned list, in call order."""
    calls: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return calls
