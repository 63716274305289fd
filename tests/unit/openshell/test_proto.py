"""The driver's protos against OpenShell's own at tag v0.1.2, as descriptors built from the
upstream files (tests/fixtures/openshell/README.md): every message and field of ours has
upstream's name, number, type and label (and upstream's reserved numbers stay reserved), every
message, field and method of upstream's compute_driver.proto and extension.proto is ours, and
bytes encoded by either side decode on the other and come back unchanged."""

from __future__ import annotations

from typing import Any

import pytest
from framework.openshell_client import upstream_pool
from google.protobuf import descriptor, message_factory

from vmsandbox.openshell.proto import compute_driver_pb2, extension_pb2, sandbox_pb2

OURS = {
    "compute_driver.proto": compute_driver_pb2.DESCRIPTOR,
    "extension.proto": extension_pb2.DESCRIPTOR,
    "sandbox.proto": sandbox_pb2.DESCRIPTOR,
}
# Upstream files vmsandbox declares in full; of sandbox.proto it declares the policy only.
WHOLE = ("compute_driver.proto", "extension.proto")
UPSTREAM = upstream_pool()


def _messages(file: descriptor.FileDescriptor) -> list[descriptor.Descriptor]:
    found: list[descriptor.Descriptor] = []

    def walk(messages: list[descriptor.Descriptor]) -> None:
        for message in messages:
            found.append(message)
            walk(list(message.nested_types))

    walk(list(file.message_types_by_name.values()))
    return found


def _shape(field: descriptor.FieldDescriptor) -> tuple[Any, ...]:
    """What decides a field's wire form and meaning: name, number, type, label, the type it
    names, presence (proto3 ``optional``) and its oneof."""
    return (
        field.name,
        field.number,
        field.type,
        field.is_repeated,
        field.message_type.full_name if field.message_type else None,
        field.enum_type.full_name if field.enum_type else None,
        field.has_presence,
        field.containing_oneof.name if field.containing_oneof else None,
    )


OUR_MESSAGES = [message for file in OURS.values() for message in _messages(file)]
UPSTREAM_WHOLE = [message for name in WHOLE for message in _messages(UPSTREAM.FindFileByName(name))]


def test_the_fixture_is_the_tag_the_driver_follows():
    compute = UPSTREAM.FindFileByName("compute_driver.proto")
    assert compute.package == "openshell.compute.v1"
    assert [dep.name for dep in compute.dependencies] == [
        "google/protobuf/struct.proto",
        "google/protobuf/timestamp.proto",
        "extension.proto",
        "options.proto",
        "sandbox.proto",
    ]
    assert (
        "resource_admission_policy"
        in UPSTREAM.FindMessageTypeByName(
            "openshell.compute.v1.GetCapabilitiesResponse"
        ).fields_by_name
    )


@pytest.mark.parametrize("ours", OUR_MESSAGES, ids=lambda m: m.full_name)
def test_every_field_of_ours_is_upstreams(ours: descriptor.Descriptor):
    theirs = UPSTREAM.FindMessageTypeByName(ours.full_name)
    for field in ours.fields:
        assert field.number in theirs.fields_by_number, f"{ours.full_name}.{field.name}"
        assert _shape(field) == _shape(theirs.fields_by_number[field.number])
    for start, end in _reserved(theirs):
        taken = [f.name for f in ours.fields if start <= f.number < end]
        assert not taken, f"{ours.full_name}: {taken} use numbers upstream reserves"


@pytest.mark.parametrize("theirs", UPSTREAM_WHOLE, ids=lambda m: m.full_name)
def test_every_field_of_upstreams_is_ours(theirs: descriptor.Descriptor):
    ours = compute_driver_pb2.DESCRIPTOR.pool.FindMessageTypeByName(theirs.full_name)
    assert {f.number: _shape(f) for f in ours.fields} == {
        f.number: _shape(f) for f in theirs.fields
    }
    assert _reserved(ours) == _reserved(theirs)


def _reserved(message: descriptor.Descriptor) -> list[tuple[int, int]]:
    from google.protobuf import descriptor_pb2

    proto = descriptor_pb2.DescriptorProto()
    message.CopyToProto(proto)
    return [(r.start, r.end) for r in proto.reserved_range]


def test_the_service_is_upstreams():
    theirs = UPSTREAM.FindServiceByName("openshell.compute.v1.ComputeDriver")
    ours = compute_driver_pb2.DESCRIPTOR.services_by_name["ComputeDriver"]

    def methods(service: descriptor.ServiceDescriptor) -> dict[str, tuple[Any, ...]]:
        return {
            m.name: (
                m.input_type.full_name,
                m.output_type.full_name,
                m.client_streaming,
                m.server_streaming,
            )
            for m in service.methods
        }

    assert methods(ours) == methods(theirs)
    assert ours.full_name == theirs.full_name


def _fill(message: Any, depth: int = 0) -> Any:
    """Every field of ``message`` set to a value of its own (two entries for repeated ones,
    one for maps), nested messages down to a few levels."""
    for field in message.DESCRIPTOR.fields:
        if field.containing_oneof and message.WhichOneof(field.containing_oneof.name):
            continue  # one member of a oneof at a time
        if field.message_type and field.message_type.GetOptions().map_entry:
            key_field, value_field = field.message_type.fields
            key = _scalar(key_field)
            target = getattr(message, field.name)
            if value_field.message_type:
                if depth < 3:
                    _fill(target[key], depth + 1)
            else:
                target[key] = _scalar(value_field)
        elif field.message_type:
            if depth >= 3:
                continue
            if field.is_repeated:
                for _ in range(2):
                    _fill(getattr(message, field.name).add(), depth + 1)
            else:
                _fill(getattr(message, field.name), depth + 1)
                getattr(message, field.name).SetInParent()
        elif field.is_repeated:
            getattr(message, field.name).extend([_scalar(field), _scalar(field)])
        else:
            setattr(message, field.name, _scalar(field))
    return message


def _scalar(field: descriptor.FieldDescriptor) -> Any:
    kind = descriptor.FieldDescriptor
    if field.type == kind.TYPE_STRING:
        return f"{field.name}-{field.number}"
    if field.type == kind.TYPE_BYTES:
        return f"{field.name}-{field.number}".encode()
    if field.type == kind.TYPE_BOOL:
        return True
    if field.type == kind.TYPE_ENUM:
        return field.enum_type.values[-1].number
    if field.type in (kind.TYPE_FLOAT, kind.TYPE_DOUBLE):
        return float(field.number) + 0.5
    return field.number


def _upstream_class(full_name: str) -> Any:
    return message_factory.GetMessageClass(UPSTREAM.FindMessageTypeByName(full_name))


@pytest.mark.parametrize("ours", OUR_MESSAGES, ids=lambda m: m.full_name)
def test_bytes_go_both_ways(ours: descriptor.Descriptor):
    """Upstream-encoded bytes decode into ours and re-encode to what upstream decodes as the
    same message (fields ours leaves out ride along as unknown fields); ours the other way."""
    upstream_class = _upstream_class(ours.full_name)
    our_class = message_factory.GetMessageClass(ours)
    sent = _fill(upstream_class())
    received = our_class.FromString(sent.SerializeToString())
    assert upstream_class.FromString(received.SerializeToString()) == sent
    ours_sent = _fill(our_class())
    assert ours_sent.ByteSize() > 0 or not ours.fields
    theirs = upstream_class.FromString(ours_sent.SerializeToString())
    assert our_class.FromString(theirs.SerializeToString()) == ours_sent
    for field in ours.fields:  # every field ours sets is one upstream reads as the same value
        if not field.is_repeated and not field.message_type and not field.containing_oneof:
            assert getattr(theirs, field.name) == getattr(ours_sent, field.name)
