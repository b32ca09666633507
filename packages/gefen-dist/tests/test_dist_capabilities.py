"""Capabilities: immutable declarations and a check that fails before training."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gefen_dist.capabilities import (
    GEFEN_CAPABILITIES,
    Capabilities,
    Layout,
    Transport,
    UnsupportedCombinationError,
    capabilities_of,
    check_capabilities,
    detect_layouts,
    register_capabilities,
)


class _Base(torch.optim.SGD):
    pass


class _Child(_Base):
    pass


class _Declared(torch.optim.SGD):
    gefen_capabilities = Capabilities(
        layouts={Layout.REPLICATED}, transports={Transport.NATIVE},
        hints={Layout.FSDP2_SHARD0: "use the sharded variant"},
    )


def test_capabilities_are_immutable():
    caps = GEFEN_CAPABILITIES
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.layouts = frozenset()  # type: ignore[misc]
    with pytest.raises(TypeError):
        caps.hints[Layout.REPLICATED] = "x"  # type: ignore[index]
    assert isinstance(caps.layouts, frozenset)
    hash(caps)


def test_unknown_class_fails_closed():
    with pytest.raises(UnsupportedCombinationError, match="declares no gefen capabilities"):
        check_capabilities(torch.optim.Adam, layout="replicated")


def test_class_attribute_and_registry_follow_the_mro():
    register_capabilities(_Base, Capabilities(
        layouts={Layout.REPLICATED, Layout.ZERO_FLAT}, transports={Transport.NATIVE}))
    assert capabilities_of(_Child).supports(layout="zero_flat")
    assert capabilities_of(_Declared) is _Declared.gefen_capabilities
    opt = _Declared([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert check_capabilities(opt, layout=Layout.REPLICATED, transport="native")


def test_unsupported_combination_names_the_alternative():
    with pytest.raises(UnsupportedCombinationError) as info:
        check_capabilities(_Declared, layout="fsdp2_shard0", transport="dcp_reshard_exact")
    msg = str(info.value)
    assert "use the sharded variant" in msg
    assert "'dcp_reshard_exact' is not supported" in msg and "['native']" in msg


def test_bad_values_are_rejected():
    with pytest.raises(ValueError):
        check_capabilities(_Declared, layout="zero3")
    with pytest.raises(TypeError):
        register_capabilities(object(), GEFEN_CAPABILITIES)  # type: ignore[arg-type]


def test_builtin_gefen_rejects_fsdp2_and_points_to_sharded_gefen():
    from gefen_core import Gefen

    with pytest.raises(UnsupportedCombinationError, match="ShardedGefen"):
        check_capabilities(Gefen, layout=Layout.FSDP2_SHARD0)
    check_capabilities(Gefen, layout=Layout.REPLICATED, transport=Transport.NATIVE)


def test_detect_layouts_plain_tensors():
    assert detect_layouts([torch.zeros(2), torch.zeros(3)]) == {Layout.REPLICATED}


def test_an_instance_is_checked_for_what_it_is():
    """With an instance, check_capabilities narrows the transports by its options: a
    capturable Gefen has no GefenDCPState transport (its constructor refuses it too)."""
    from gefen_core import Gefen

    params = [torch.nn.Parameter(torch.zeros(4, 3))]
    assert check_capabilities(Gefen(params), transport=Transport.DCP_RESHARD_EXACT)
    opt = Gefen(params, capturable=True)
    assert check_capabilities(opt).supports(transport=Transport.NATIVE)
    assert not check_capabilities(opt).supports(transport=Transport.DCP_RESHARD_EXACT)
    with pytest.raises(UnsupportedCombinationError, match="capturable=False"):
        check_capabilities(opt, transport="dcp_reshard_approx")
    # The class alone still declares the transport.
    check_capabilities(Gefen, transport=Transport.DCP_RESHARD_EXACT)
