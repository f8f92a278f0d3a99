"""The lifecycle state machine, checked over random transition sequences."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.factories import NOW, snapshot
from torpor.errors import IllegalTransition, TerminalStateImmutable
from torpor.lifecycle import ALLOWED, TERMINAL_STATES, SessionState, bumps_epoch, transition
from torpor.models import MAX_HISTORY

S = SessionState


def test_happy_path_with_one_wait() -> None:
    snap = snapshot()
    for target in (S.RUNNING, S.SUSPENDED, S.RESUMING, S.RUNNING, S.COMPLETED):
        snap = transition(snap, target, now=NOW)
    assert snap.state is S.COMPLETED
    assert snap.epoch == 2  # one wait opened, one closed
    assert [h.state for h in snap.history] == [
        S.RUNNING,
        S.SUSPENDED,
        S.RESUMING,
        S.RUNNING,
        S.COMPLETED,
    ]


def test_illegal_move_is_typed_and_changes_nothing() -> None:
    snap = snapshot()
    with pytest.raises(IllegalTransition, match="PENDING to SUSPENDED"):
        transition(snap, S.SUSPENDED, now=NOW)
    assert snap.state is S.PENDING and snap.history == []


def test_terminal_states_are_immutable() -> None:
    for terminal in TERMINAL_STATES:
        snap = snapshot().model_copy(update={"state": terminal})
        for target in S:
            with pytest.raises(TerminalStateImmutable):
                transition(snap, target, now=NOW)


def test_going_back_to_sleep_keeps_the_epoch() -> None:
    snap = snapshot()
    for target in (S.RUNNING, S.SUSPENDED, S.RESUMING):
        snap = transition(snap, target, now=NOW)
    epoch = snap.epoch
    snap = transition(snap, S.SUSPENDED, now=NOW)  # a stale event woke it; nothing applied
    assert snap.epoch == epoch


def test_history_is_bounded() -> None:
    snap = transition(snapshot(), S.RUNNING, now=NOW)
    snap = transition(snap, S.SUSPENDED, now=NOW)
    for i in range(MAX_HISTORY):
        snap = transition(snap, S.RESUMING, now=NOW + timedelta(seconds=i))
        snap = transition(snap, S.SUSPENDED, now=NOW + timedelta(seconds=i))
    assert len(snap.history) == MAX_HISTORY
    assert snap.history[-1].seq == 2 + 2 * MAX_HISTORY


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list(S)), min_size=1, max_size=40))
def test_random_sequences_obey_the_table(targets: list[SessionState]) -> None:
    snap = snapshot()
    for target in targets:
        before = snap
        legal = not before.state.terminal and target in ALLOWED[before.state]
        if legal:
            snap = transition(before, target, now=NOW)
            assert snap.state is target
            assert snap.epoch == before.epoch + (1 if bumps_epoch(before.state, target) else 0)
            assert snap.history[-1].state is target and snap.history[-1].epoch == snap.epoch
        else:
            expected = TerminalStateImmutable if before.state.terminal else IllegalTransition
            with pytest.raises(expected):
                transition(before, target, now=NOW)
            assert snap == before  # a refused move leaves the snapshot untouched
        # invariants that hold after any sequence
        assert [h.seq for h in snap.history] == sorted({h.seq for h in snap.history})
        assert all(a.epoch <= b.epoch for a, b in zip(snap.history, snap.history[1:], strict=False))
        assert snap.state is (snap.history[-1].state if snap.history else S.PENDING)


@given(st.sampled_from([s for s in S if s not in TERMINAL_STATES]))
def test_every_live_state_can_end(state: SessionState) -> None:
    assert ALLOWED[state] & TERMINAL_STATES


def test_quarantine_sets_a_waiting_session_aside_with_its_epoch() -> None:
    snap = snapshot()
    for target in (S.RUNNING, S.SUSPENDED, S.RESUMING):
        snap = transition(snap, target, now=NOW)
    epoch = snap.epoch
    aside = transition(snap, S.QUARANTINED, now=NOW)
    assert aside.epoch == epoch, "its waits stay open, so their epoch stays current"
    assert transition(aside, S.SUSPENDED, now=NOW).epoch == epoch  # operator retry
    assert transition(aside, S.CANCELLED, now=NOW).state is S.CANCELLED  # operator cancel


def test_only_an_operator_takes_a_session_out_of_quarantine() -> None:
    assert ALLOWED[S.QUARANTINED] == {S.PENDING, S.RUNNING, S.SUSPENDED, S.CANCELLED}
    for source in (S.PENDING, S.RUNNING, S.SUSPENDED, S.RESUMING):
        assert S.QUARANTINED in ALLOWED[source]
    assert not S.QUARANTINED.terminal
