"""Which Triton versions take the register gather of the momentum codewords."""

from __future__ import annotations

import pytest

from gefen_kernels import _triton


@pytest.mark.parametrize(("version", "expected"), [
    ("3.3.1", False), ("3.5.0", False), ("3.6.0", True), ("3.9.0", True), ("4.0.0", True),
    ("3.10.0+git1234", True), ("unknown", False),
])
def test_gather_supported_follows_the_version(monkeypatch: pytest.MonkeyPatch, version: str,
                                              expected: bool) -> None:
    class FakeTriton:
        __version__ = version

    monkeypatch.setattr(_triton, "triton", FakeTriton)
    assert _triton.gather_supported() is expected


def test_gather_supported_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_triton, "triton", None)
    assert _triton.gather_supported() is False
