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
