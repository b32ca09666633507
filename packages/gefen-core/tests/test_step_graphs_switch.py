"""Graph replay of eager fused steps is opt-in (``gefen_kernels.ops._step_graphs``): off unless
``GEFEN_CUDA_GRAPHS=1``, so the default step is the eager launches."""

from __future__ import annotations

import pytest

from gefen_kernels.ops import _step_graphs


@pytest.mark.parametrize(("value", "expected"), [(None, False), ("0", False), ("", False),
                                                 ("1", True)])
def test_graph_replay_is_opt_in(monkeypatch: pytest.MonkeyPatch, value: str | None,
                                expected: bool) -> None:
    if value is None:
        monkeypatch.delenv("GEFEN_CUDA_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("GEFEN_CUDA_GRAPHS", value)
    assert _step_graphs.enabled() is expected
