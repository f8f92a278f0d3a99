"""The domain models' own shallow copy (``torpor.models._Model.model_copy``): what
pydantic's gives, without its generic steps."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from tests.support.factories import NOW, busy_snapshot, snapshot
from torpor.lifecycle import SessionState
from torpor.models import Message, OutboxEntry, OutboxKind, RetryQuota, SessionSnapshot


def pydantics(model: BaseModel, update: dict[str, Any] | None = None) -> BaseModel:
    return BaseModel.model_copy(model, update=update)


def same(ours: BaseModel, theirs: BaseModel) -> None:
    assert type(ours) is type(theirs)
    assert ours.__dict__ == theirs.__dict__
    assert ours.model_fields_set == theirs.model_fields_set
    assert ours.__pydantic_extra__ == theirs.__pydantic_extra__
    assert ours.__pydantic_private__ == theirs.__pydantic_private__
    assert ours.model_dump_json() == theirs.model_dump_json()


@pytest.mark.parametrize(
    "update",
    [
        None,
        {},
        {"step": 3},
        {"state": SessionState.RUNNING, "epoch": 1, "updated_at": NOW},
        {"waits": [], "result": {"ok": True}},
    ],
)
def test_a_snapshot_copy_is_pydantics(update: dict[str, Any] | None) -> None:
    snap = busy_snapshot(messages=6)
    same(snap.model_copy(update=update), pydantics(snap, update))


def test_smaller_models_copy_as_pydantics_do() -> None:
    for model, update in [
        (busy_snapshot(messages=4).waits[0], {"deadline": NOW}),
        (Message(role="user", content="hi"), {"content": "there"}),
        (RetryQuota(), {"used": 2}),
        (
            OutboxEntry(
                entry_id="e1",
                kind=OutboxKind.NOTIFY,
                idempotency_key="k1",
                created_at=NOW,
            ),
            {"attempts": 1},
        ),
    ]:
        same(model.model_copy(update=update), pydantics(model, update))


def test_a_copy_shares_no_bookkeeping_with_its_original() -> None:
    snap = snapshot()
    given = set(snap.model_fields_set)
    copied = snap.model_copy(update={"step": 9})
    copied.__dict__["epoch"] = 41
    copied.model_fields_set.add("epoch")
    assert snap.step == 0 and snap.epoch == 0
    assert snap.model_fields_set == given
    again = snap.model_copy()  # no update: the set of fields given is a copy all the same
    again.model_fields_set.add("epoch")
    assert snap.model_fields_set == given


def test_an_update_is_not_validated_as_pydantics_is_not() -> None:
    snap = snapshot()
    copied = snap.model_copy(update={"step": "not a number"})
    assert copied.step == "not a number"  # the caller's promise, as with pydantic's


def test_a_deep_copy_is_left_to_pydantic() -> None:
    snap = snapshot(messages=4)
    deep = snap.model_copy(deep=True)
    assert deep == snap
    assert deep.messages is not snap.messages and deep.messages[1] is not snap.messages[1]


def test_a_shallow_copy_skips_pydantics_generic_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The point of the override (the resume path copies its snapshot ~16 times): neither
    ``BaseModel.__copy__`` nor ``copy.copy`` runs."""

    def refused(self: BaseModel) -> BaseModel:
        raise AssertionError("pydantic's __copy__ ran")

    monkeypatch.setattr(BaseModel, "__copy__", refused)
    snap = snapshot()
    copied = snap.model_copy(update={"step": 1})
    assert isinstance(copied, SessionSnapshot) and copied.step == 1
