"""The core's settings: the `[router]` section, and what a reload may change in place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gateway.core.attachments import MediaSettings
from gateway.core.ports import Agent
from gateway.core.quotas import QuotaSettings

BusyPolicy = Literal["interrupt", "queue", "steer"]
BUSY_POLICIES: tuple[BusyPolicy, ...] = ("interrupt", "queue", "steer")


@dataclass
class RouterSettings:
    """The `[router]` section of the config."""

    busy: BusyPolicy = "interrupt"
    per_user_in_groups: bool = False
    max_message_chars: int = 16_000
    turn_timeout_s: float = 600.0
    messages_per_minute: int = 20  # per user (per session id on the API); excess gets one notice, then silence; 0 = off


@dataclass(frozen=True, slots=True)
class CoreSettings:
    """Everything the core reads that a reload may replace. Read through a `Live` holder each time
    it is needed; a turn keeps the agent it started with."""

    agent: Agent
    router: RouterSettings = field(default_factory=RouterSettings)
    media: MediaSettings = field(default_factory=MediaSettings)
    quotas: QuotaSettings = field(default_factory=QuotaSettings)
    vision: bool = True  # may images go to the model (`[agent] vision`)
    cancel_grace_s: float = 2.0  # how long a cancelled turn's task may take to end before its lane moves on
    resume_max_age_s: float = 600.0  # turns cut off longer ago than this are not resumed
