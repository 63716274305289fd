"""Reading the host kernel's log from a cursor (host/kernlog.py), on a plain file written in
/dev/kmsg's record format."""

from __future__ import annotations

from pathlib import Path

from vmsandbox.host.kernlog import KernelLog, parse_record


def record(sequence: int, text: str) -> str:
    return f"3,{sequence},{sequence * 1000},-;{text}\n SUBSYSTEM=pci\n"


def test_a_record_parses() -> None:
    parsed = parse_record(b"3,42,123456,-;pcieport 0000:00:06.0: AER: x")
    assert parsed is not None and (parsed.sequence, parsed.microseconds) == (42, 123456)
    assert parse_record(b" DEVICE=+pci:0000:00:06.0") is None


def test_the_first_read_starts_at_the_end_and_later_ones_read_on(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(record(1, "old error") + record(2, "older line"))
    log = KernelLog(tmp_path / "cursor", str(kmsg))
    assert log.new() == []
    with kmsg.open("a") as out:
        out.write(record(3, "new error"))
    assert [r.text for r in log.new()] == ["new error"]
    assert log.new() == []
    log.close()


def test_a_new_reader_goes_on_from_the_stored_cursor(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(record(1, "a") + record(2, "b"))
    first = KernelLog(tmp_path / "cursor", str(kmsg))
    first.new()
    first.close()
    with kmsg.open("a") as out:
        out.write(record(3, "seen while no reader ran"))
    again = KernelLog(tmp_path / "cursor", str(kmsg))
    assert [r.text for r in again.new()] == ["seen while no reader ran"]
    again.close()
