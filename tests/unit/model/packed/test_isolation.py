"""The one isolation registry: every module that must see each document alone is in it, and its one test switch
turns isolation off for the named kinds only, and back on after."""

import pytest

from chattune.model.packed import indexed_attention, isolation, mixers, rotary


def test_every_per_document_module_registers_its_kind():
    assert {mixers.MIXERS, rotary.ROTARIES, indexed_attention.INDEXERS} <= set(isolation.registered())
    assert all(isolation.isolating(kind) for kind in isolation.registered())


def test_leaking_turns_off_the_named_kinds_only_and_restores_them():
    with isolation.leaking(mixers.MIXERS):
        assert not isolation.isolating(mixers.MIXERS)
        assert isolation.isolating(rotary.ROTARIES)
        with isolation.leaking():  # every kind, nested: leaving it must not turn the outer one back on
            assert not any(isolation.isolating(kind) for kind in isolation.registered())
        assert not isolation.isolating(mixers.MIXERS)
        assert isolation.isolating(rotary.ROTARIES)
    assert all(isolation.isolating(kind) for kind in isolation.registered())


def test_an_unknown_kind_is_refused_with_the_registered_ones_named():
    with pytest.raises(ValueError, match="registered: .*mixers"), isolation.leaking("mixer"):
        pass


def test_a_kind_registered_twice_with_another_meaning_is_refused():
    with pytest.raises(ValueError, match="registered twice"):
        isolation.register(mixers.MIXERS, "something else")
