"""Identifiers and object keys are checked against their alphabet, whole."""

from __future__ import annotations

import pytest

from storage import keys
from torpor.errors import InvalidKey


@pytest.mark.parametrize("bad", ["s1\n", "s1\nx", "\n", ".."])
def test_an_identifier_outside_the_alphabet_is_refused(bad: str) -> None:
    """A line feed too, last or not: ``$`` would let a final one through."""
    with pytest.raises(InvalidKey):
        keys.live(bad)


def test_every_states_sessions_names_each_states_set_in_order_for_any_number_of_tenants() -> None:
    from storage.keys import _TENANTS_REMEMBERED, RedisKeys
    from torpor.lifecycle import SessionState

    names = RedisKeys("p:")
    for n in range(_TENANTS_REMEMBERED + 5):  # past what is kept: still the right names
        tenant = f"t{n}"
        expected = tuple(names.sessions(tenant, s) for s in SessionState)
        assert names.every_states_sessions(tenant) == expected
        assert names.every_states_sessions(tenant) == expected  # kept or made again
    assert len(names._state_sets) == _TENANTS_REMEMBERED
