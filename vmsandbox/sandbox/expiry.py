"""Times of a sandbox's lifetime as its record keeps them: UTC, to the second, the same format as
``created_at``. Pure functions: lifetime.py extends and reaps with them, handle.py shows the time
left, plan.py stamps a new record."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from vmsandbox.validate import check_duration

TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def stamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime(TIME_FORMAT)


def now() -> datetime:
    return datetime.now(UTC)


def ends_at(ttl: float | None, start: datetime | None = None) -> str | None:
    """The end of a lifetime of ``ttl`` seconds from ``start`` (now); None without a ttl."""
    if ttl is None:
        return None
    return stamp((start or now()) + timedelta(seconds=check_duration(ttl, "ttl")))


def parse(expires_at: str) -> datetime | None:
    """A recorded expiry as a time; None when it is not one (never taken for a past one)."""
    try:
        return datetime.strptime(expires_at, TIME_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        return None


def seconds_left(expires_at: str | None, at: datetime | None = None) -> float | None:
    """Seconds until ``expires_at`` (0 once it has passed); None without a readable expiry."""
    end = parse(expires_at) if expires_at else None
    if end is None:
        return None
    return max(0.0, (end - (at or now())).total_seconds())
