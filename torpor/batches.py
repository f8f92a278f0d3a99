"""Batches: one session per document, submitted together and followed as one."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pydantic import BaseModel, ConfigDict

from torpor.lifecycle import SessionState


class BatchManifest(BaseModel):
    """The durable record of a batch: which session each document became."""

    model_config = ConfigDict(extra="forbid")

    batch_id: str
    tenant: str
    agent: str
    session_ids: list[str]
    created_at: datetime


@dataclass(frozen=True)
class BatchProgress:
    batch_id: str
    total: int
    by_state: dict[str, int]

    @property
    def done(self) -> int:
        return sum(n for s, n in self.by_state.items() if SessionState(s).terminal)

    @property
    def finished(self) -> bool:
        return self.done == self.total
