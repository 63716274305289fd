"""The ``Hypervisor`` contract: the promises of vm/hypervisor.py's Protocol docstring and of
``LibvirtHypervisor``, run against both implementations the tests use.

The manager's unit tests run on ``FakeHypervisor`` (tests/framework/fake_hypervisor.py),
production on ``LibvirtHypervisor``. A fake that drifts from libvirt lets the manager's tests pass
on behaviour libvirt never shows, so every promise below runs twice: on the fake, and on
``LibvirtHypervisor`` over libvirt's test driver (``test:///default``: a real libvirt connection,
in-process, no daemon, shared by this process's connections and forgotten with the last one).
Where the two disagreed, the fake was made to behave as libvirt does.

What the test driver (libvirt 9.0) cannot do, and how this file deals with it:

- It has no ``virDomainAttachDeviceFlags``/``virDomainDetachDeviceFlags`` (VIR_ERR_NO_SUPPORT):
  attaching to and detaching from a domain that exists is checked on the fake only; detaching
  from a domain that does not exist runs on both.
- Its ``undefineFlags`` refuses VIR_DOMAIN_UNDEFINE_NVRAM, which the QEMU driver takes: the
  adapter (``_QemuLikeDomain``) drops that flag.
- It keeps no state of a virtio channel's guest end: ``channel_state`` answers None for it, as
  the fake does unless a test sets one (the QEMU driver's "connected" is checked by
  tests/e2e/test_suspend.py).
- Its managed save keeps no file: ``saved`` answers 0 bytes for it (the QEMU driver's size is
  its file's, checked by tests/e2e/test_suspend.py).
- It reports the shutdown of a stopped domain as VIR_ERR_INTERNAL_ERROR where the QEMU driver
  reports VIR_ERR_OPERATION_INVALID ("domain is not running"), and undefines a transient domain
  (one undefined while it runs) where the QEMU driver refuses with VIR_ERR_OPERATION_INVALID
  ("cannot undefine transient domain"): the adapter raises the test driver's own
  OPERATION_INVALID for both (from a call that it refuses so, which changes nothing).
- It powers a guest off at once on the ACPI button, as the fake does (a real guest may take its
  time, or ignore it), and makes up a DHCP lease for every running domain with an interface.

It accepts a PCI ``<hostdev>`` in a defined domain (nothing is bound: no host device is
touched), so ``hostdev_holders`` runs on both. The connection is lost on purpose by handing
``LibvirtHypervisor`` a closed connection: libvirt's own error for a connection that is gone.
"""

from __future__ import annotations

import inspect
import uuid as uuids
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import libvirt
import pytest
from framework.fake_hypervisor import FakeHypervisor
from lxml import etree

from vmsandbox.errors import FailedPrecondition, NotFound, Unavailable
from vmsandbox.host.holders import hostdev_addresses
from vmsandbox.vm import domain as domain_xml
from vmsandbox.vm.hypervisor import Hypervisor, LibvirtHypervisor, Stored

TEST_DRIVER = "test:///default"
_CONFIG = libvirt.VIR_DOMAIN_AFFECT_CONFIG
PROTOCOL_METHODS = sorted(
    name for name, value in vars(Hypervisor).items() if callable(value) and name[0] != "_"
)


def hostdev(bus: int, function: int = 0, guest_bus: int | None = None) -> str:
    """A host PCI device's ``<hostdev>`` as passthrough and hotplug write it (with
    ``guest_bus``: at slot 0 of that guest bus, its host function number)."""
    guest = (
        f"<address type='pci' domain='0x0000' bus='0x{guest_bus:02x}' slot='0x00' "
        f"function='0x{function:x}'/>"
        if guest_bus is not None
        else ""
    )
    return (
        "<hostdev mode='subsystem' type='pci' managed='yes'><source>"
        f"<address domain='0x0000' bus='0x{bus:02x}' slot='0x00' function='0x{function:x}'/>"
        f"</source>{guest}</hostdev>"
    )


# -- the two implementations -------------------------------------------------------------------


class _QemuLikeDomain:
    """A test-driver domain that answers as the QEMU driver where the two differ (see the
    module docstring); everything else is the test driver's own."""

    def __init__(self, dom: libvirt.virDomain) -> None:
        self.dom = dom

    def undefineFlags(self, flags: int = 0) -> int:
        if not self.dom.isPersistent():  # raises VIR_ERR_OPERATION_INVALID, as QEMU does:
            self.dom.setMetadata(libvirt.VIR_DOMAIN_METADATA_TITLE, "", None, None, _CONFIG)
        return int(self.dom.undefineFlags(flags & ~libvirt.VIR_DOMAIN_UNDEFINE_NVRAM))

    def shutdown(self) -> int:
        if not self.dom.isActive():
            self.dom.destroy()  # raises VIR_ERR_OPERATION_INVALID, as QEMU's shutdown does
        return int(self.dom.shutdown())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dom, name)


class _QemuLikeConnection:
    def __init__(self, conn: libvirt.virConnect) -> None:
        self.conn = conn

    def lookupByName(self, name: str) -> _QemuLikeDomain:
        return _QemuLikeDomain(self.conn.lookupByName(name))

    def lookupByUUIDString(self, uuid: str) -> _QemuLikeDomain:
        return _QemuLikeDomain(self.conn.lookupByUUIDString(uuid))

    def listAllDomains(self, flags: int = 0) -> list[_QemuLikeDomain]:
        return [_QemuLikeDomain(dom) for dom in self.conn.listAllDomains(flags)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


class OnTestDriver(LibvirtHypervisor):
    """``LibvirtHypervisor`` itself, on the test driver made QEMU-like. Once ``lost`` is set,
    libvirtd is gone: "at once", every call fails as on a connection that is closed (libvirt's
    own error for it); "mid listing", the domains are listed and every read of one fails."""

    lost: str | None = None

    @property
    def conn(self) -> Any:
        real = _QemuLikeConnection(super().conn)
        if self.lost is None:
            return real
        gone = libvirt.open(self.uri)
        gone.close()
        return gone if self.lost == "at once" else _ListsThenFails(real, gone)


class _ListsThenFails:
    def __init__(self, real: _QemuLikeConnection, gone: libvirt.virConnect) -> None:
        self.real, self.gone = real, gone

    def listAllDomains(self, flags: int = 0) -> list[_Unreadable]:
        return [_Unreadable(dom, self.gone) for dom in self.real.listAllDomains(flags)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.gone, name)


class _Unreadable:
    """A listed domain: its name is known, every read of it fails."""

    def __init__(self, dom: _QemuLikeDomain, gone: libvirt.virConnect) -> None:
        self.dom, self.gone = dom, gone

    def name(self) -> str:
        return str(self.dom.name())

    def __getattr__(self, _name: str) -> Any:
        return lambda *_args: self.gone.lookupByName(self.dom.name())  # raises


@dataclass
class Kind:
    """One implementation under test, with what the Protocol has no method for."""

    name: str
    hv: Hypervisor
    virt_type: str
    lose_connection: Callable[[], None]
    prefix: str = field(default_factory=lambda: f"vmsbx-ct{uuids.uuid4().hex[:8]}-")

    def domain(self, short: str) -> str:
        return self.prefix + short

    def xml(
        self,
        short: str,
        uuid: str | None = None,
        *,
        state: str = "creating",
        hostdevs: tuple[str, ...] = (),
        devices: tuple[str, ...] = (),
        ours: bool = True,
    ) -> str:
        """The domain XML the manager makes (domain.build_domain_xml), for this kind."""
        plan = domain_xml.DomainPlan(
            domain_name=self.domain(short),
            uuid=uuid or str(uuids.uuid4()),
            virt_type=self.virt_type,
            cpus=1,
            memory_mib=64,
            overlay=Path("/nonexistent/overlay.qcow2"),
            seed=Path("/nonexistent/seed.img"),
            console_log=Path("/nonexistent/console.log"),
            record={"name": short},
            state=state,
            ssh_port=2222,
            extra=[_devices((*hostdevs, *devices))],
        )
        root = etree.fromstring(domain_xml.build_domain_xml(plan).encode())
        if not ours:
            root.remove(root.find("metadata"))
        return etree.tostring(root, encoding="unicode")

    def define(self, short: str, uuid: str | None = None, **kwargs: Any) -> str:
        """Define the domain; its UUID."""
        uuid = uuid or str(uuids.uuid4())
        self.hv.define(self.xml(short, uuid, **kwargs))
        return uuid

    def mine(self, stored: list[Stored]) -> list[Stored]:
        """This test's domains (the test driver has its own ``test`` domain, and others'
        may share it)."""
        return sorted((s for s in stored if s.domain.startswith(self.prefix)), key=str)


def _devices(xmls: tuple[str, ...]) -> Callable[[etree._Element], None]:
    def add(root: etree._Element) -> None:
        for xml in xmls:
            root.find("devices").append(etree.fromstring(xml))

    return add


def _fake() -> Iterator[Kind]:
    hv = FakeHypervisor()

    def lose_connection() -> None:
        def gone(_domain: str) -> None:
            raise Unavailable("libvirt is unavailable: the fake's connection is gone")

        for operation in PROTOCOL_METHODS:
            hv.before[operation] = gone

    yield Kind("fake", hv, "kvm", lose_connection)


def _test_driver() -> Iterator[Kind]:
    keeper = libvirt.open(TEST_DRIVER)  # keeps the driver's state while ``hv`` reconnects
    hv = OnTestDriver(TEST_DRIVER)

    def lose_connection() -> None:
        hv.lost = "at once"

    kind = Kind("libvirt", hv, "test", lose_connection)
    try:
        yield kind
    finally:
        hv.close()
        for dom in keeper.listAllDomains(0):
            if dom.name().startswith(kind.prefix):
                persistent = dom.isPersistent()
                if dom.isActive():
                    dom.destroy()
                if persistent:
                    dom.undefine()
        keeper.close()


@pytest.fixture(params=["fake", "libvirt"])
def kind(request: pytest.FixtureRequest) -> Iterator[Kind]:
    """A fresh hypervisor of each kind."""
    yield from (_fake() if request.param == "fake" else _test_driver())


@pytest.fixture
def on_test_driver() -> Iterator[Kind]:
    yield from _test_driver()


@pytest.fixture
def on_fake() -> Iterator[Kind]:
    """The fake alone: for promises the test driver cannot show (it cannot attach or detach)."""
    yield from _fake()


# -- shape -------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", [FakeHypervisor, LibvirtHypervisor])
@pytest.mark.parametrize("method", PROTOCOL_METHODS)
def test_every_protocol_method_has_its_signature(implementation: type, method: str) -> None:
    assert inspect.signature(getattr(implementation, method)) == inspect.signature(
        getattr(Hypervisor, method)
    )


# -- define, list, metadata --------------------------------------------------------------------


def test_a_defined_domain_is_listed_with_its_uuid_and_record(kind: Kind) -> None:
    uuid = kind.define("a")
    name = kind.domain("a")
    stored = Stored(name, {"name": "a"}, "creating", uuid)
    assert kind.mine(kind.hv.list(kind.prefix)) == [stored]
    assert kind.hv.list(kind.prefix + "b") == []
    assert kind.mine(kind.hv.every_domain()) == [stored]
    assert kind.hv.metadata(name) == stored
    assert not kind.hv.running(name)


def test_a_domain_without_our_metadata_is_listed_as_not_ours(kind: Kind) -> None:
    uuid = kind.define("other", ours=False)
    stored = Stored(kind.domain("other"), None, "unknown", uuid)
    assert kind.hv.list(kind.prefix) == [stored]
    assert kind.hv.metadata(kind.domain("other")) == stored


def test_the_definition_carries_the_name_uuid_and_record(kind: Kind) -> None:
    uuid = kind.define("a", state="stopped")
    root = etree.fromstring(kind.hv.definition(kind.domain("a")).encode())
    assert (root.findtext("name"), root.findtext("uuid")) == (kind.domain("a"), uuid)
    assert domain_xml.read_metadata(etree.tostring(root, encoding="unicode")) == (
        {"name": "a"},
        "stopped",
    )


@pytest.mark.parametrize("running", [False, True], ids=["stopped", "running"])
def test_set_metadata_round_trips_into_the_definition(kind: Kind, running: bool) -> None:
    uuid = kind.define("a")
    name = kind.domain("a")
    if running:
        kind.hv.start(name)
    record = {"name": "claimed", "gpus": [{"bdf": "0000:41:00.0"}]}
    kind.hv.set_metadata(name, record, "ready")
    assert kind.hv.metadata(name) == Stored(name, record, "ready", uuid)
    assert kind.hv.list(kind.prefix) == [Stored(name, record, "ready", uuid)]
    definition = kind.hv.definition(name)
    assert domain_xml.read_metadata(definition) == (record, "ready")
    assert etree.fromstring(definition.encode()).findtext("title") == "claimed"
    assert kind.hv.running(name) is running


def test_a_redefinition_replaces_the_record(kind: Kind) -> None:
    uuid = kind.define("a")
    name = kind.domain("a")
    kind.define("a", uuid, state="stopped")
    assert kind.hv.metadata(name) == Stored(name, {"name": "a"}, "stopped", uuid)


def test_a_running_domain_redefined_runs_on_its_old_definition_until_it_is_off(
    kind: Kind,
) -> None:
    """libvirt's next config: the listings read the running guest's record and devices,
    ``definition`` the new one, which the domain has once it is off. (The manager redefines
    stopped domains only, power.py; the fake keeps to libvirt all the same.)"""
    uuid = kind.define("a", hostdevs=(hostdev(0x41),))
    name = kind.domain("a")
    kind.hv.start(name)
    kind.define("a", uuid, state="stopped", hostdevs=(hostdev(0x42),))
    assert kind.hv.running(name)
    assert kind.hv.metadata(name) == Stored(name, {"name": "a"}, "creating", uuid)
    assert domain_xml.read_metadata(kind.hv.definition(name)) == ({"name": "a"}, "stopped")
    assert kind.mine(kind.hv.every_domain())[0].hostdevs == ("0000:42:00.0", "0000:41:00.0")
    kind.hv.stop(name)
    assert kind.hv.metadata(name) == Stored(name, {"name": "a"}, "stopped", uuid)
    assert kind.mine(kind.hv.every_domain())[0].hostdevs == ("0000:42:00.0",)


def test_a_name_or_uuid_held_by_another_domain_is_refused(kind: Kind) -> None:
    uuid = kind.define("a")
    with pytest.raises(FailedPrecondition):
        kind.define("a")  # the name, under another UUID
    with pytest.raises(FailedPrecondition):
        kind.define("b", uuid)  # the UUID, under another name
    assert [s.uuid for s in kind.hv.list(kind.prefix)] == [uuid]


# -- stop and undefine by UUID -----------------------------------------------------------------


def test_stop_and_undefine_by_uuid_leave_a_namesake_alone(kind: Kind) -> None:
    """An undo holds the UUID of the domain it made; a later call may have made another under
    the same name."""
    name = kind.domain("a")
    first = kind.define("a")
    kind.hv.undefine(name)
    second = kind.define("a")
    kind.hv.start(name)
    kind.hv.stop(name, uuid=first)
    kind.hv.undefine(name, uuid=first)
    assert kind.hv.running(name)
    assert kind.hv.list(kind.prefix) == [Stored(name, {"name": "a"}, "creating", second)]
    kind.hv.stop(name, uuid=second)
    assert not kind.hv.running(name)
    kind.hv.undefine(name, uuid=second)
    assert kind.hv.list(kind.prefix) == []


def test_a_uuid_that_matches_nothing_does_nothing(kind: Kind) -> None:
    uuid = kind.define("a")
    kind.hv.start(kind.domain("a"))
    nobody = str(uuids.uuid4())
    kind.hv.stop(kind.domain("a"), uuid=nobody)
    kind.hv.undefine(kind.domain("a"), uuid=nobody)
    assert kind.hv.running(kind.domain("a"))
    assert [s.uuid for s in kind.hv.list(kind.prefix)] == [uuid]


def test_a_uuid_reaches_its_domain_whatever_the_name(kind: Kind) -> None:
    uuid = kind.define("a")
    kind.hv.start(kind.domain("a"))
    kind.hv.stop(kind.domain("renamed"), uuid=uuid)
    assert not kind.hv.running(kind.domain("a"))
    kind.hv.undefine(kind.domain("renamed"), uuid=uuid)
    assert kind.hv.list(kind.prefix) == []


# Every call of one domain, given the UUID of a domain that is gone while another now has its
# name, and what it must answer: nothing of the namesake is read or changed.
_GONE_UUID: dict[str, tuple[Callable[[Any, str, str], object], object]] = {
    "start": (lambda hv, name, uuid: hv.start(name, uuid=uuid), NotFound),
    "stop": (lambda hv, name, uuid: hv.stop(name, uuid=uuid), None),
    "shutdown": (lambda hv, name, uuid: hv.shutdown(name, uuid=uuid), None),
    "undefine": (lambda hv, name, uuid: hv.undefine(name, uuid=uuid), None),
    "running": (lambda hv, name, uuid: hv.running(name, uuid=uuid), False),
    "stop_reason": (
        lambda hv, name, uuid: hv.stop_reason(name, uuid=uuid)[:24],
        "its state cannot be read",
    ),
    "metadata": (lambda hv, name, uuid: hv.metadata(name, uuid=uuid), None),
    "definition": (lambda hv, name, uuid: hv.definition(name, uuid=uuid), NotFound),
    "set_metadata": (
        lambda hv, name, uuid: hv.set_metadata(name, {"name": "stale"}, "ready", uuid=uuid),
        NotFound,
    ),
    "lease_address": (lambda hv, name, uuid: hv.lease_address(name, uuid=uuid), None),
    "channel_state": (lambda hv, name, uuid: hv.channel_state(name, CHANNEL, uuid=uuid), None),
    "attach": (lambda hv, name, uuid: hv.attach(name, hostdev(0x42), uuid=uuid), NotFound),
    "detach": (lambda hv, name, uuid: hv.detach(name, hostdev(0x42), uuid=uuid), None),
    "save": (lambda hv, name, uuid: hv.save(name, uuid=uuid), NotFound),
    "saved": (lambda hv, name, uuid: hv.saved(name, uuid=uuid), None),
    "discard_save": (lambda hv, name, uuid: hv.discard_save(name, uuid=uuid), None),
}


@pytest.mark.parametrize("operation", sorted(_GONE_UUID))
def test_a_call_given_a_gone_uuid_never_reaches_the_namesake(kind: Kind, operation: str) -> None:
    """A caller that looked a sandbox up and acts on it later (a readiness wait, a stop, a
    teardown) passes the UUID it found: when that domain is gone and another has its name, the
    call finds nothing, as for an absent name, and the namesake is neither read nor changed."""
    name = kind.domain("a")
    first = kind.define("a")
    kind.hv.undefine(name)
    second = kind.define("a")
    kind.hv.start(name)
    call, answer = _GONE_UUID[operation]
    if isinstance(answer, type):
        with pytest.raises(answer):
            call(kind.hv, name, first)
    else:
        assert call(kind.hv, name, first) == answer
    assert kind.hv.running(name)
    assert kind.hv.metadata(name) == Stored(name, {"name": "a"}, "creating", second)
    assert kind.hv.list(kind.prefix) == [Stored(name, {"name": "a"}, "creating", second)]


def test_every_call_of_one_domain_takes_a_uuid() -> None:
    """The promise above covers the whole Protocol: every method that names a domain."""
    per_domain = {
        name
        for name in PROTOCOL_METHODS
        if "domain" in inspect.signature(getattr(Hypervisor, name)).parameters
    }
    assert per_domain == set(_GONE_UUID)
    for name in per_domain:
        assert "uuid" in inspect.signature(getattr(Hypervisor, name)).parameters


def test_a_uuid_reads_and_writes_its_domain_whatever_the_name(kind: Kind) -> None:
    uuid = kind.define("a")
    name, other = kind.domain("a"), kind.domain("renamed")
    kind.hv.start(other, uuid=uuid)
    assert kind.hv.running(other, uuid=uuid)
    kind.hv.set_metadata(other, {"name": "a", "x": 1}, "ready", uuid=uuid)
    assert kind.hv.metadata(other, uuid=uuid) == Stored(name, {"name": "a", "x": 1}, "ready", uuid)
    assert domain_xml.read_metadata(kind.hv.definition(other, uuid=uuid)) == (
        {"name": "a", "x": 1},
        "ready",
    )
    kind.hv.shutdown(other, uuid=uuid)
    assert not kind.hv.running(name)
    assert kind.hv.stop_reason(other, uuid=uuid) == "the guest powered itself off"


def test_undefining_a_running_domain_leaves_it_running_until_it_stops(kind: Kind) -> None:
    """libvirt's transient domain: still listed, still running, holding what it holds; gone
    once it stops (an undo that undefines before it stops leaves a guest running)."""
    uuid = kind.define("a", hostdevs=(hostdev(0x41),))
    name = kind.domain("a")
    kind.hv.start(name)
    kind.hv.undefine(name)
    assert kind.hv.running(name)
    assert kind.mine(kind.hv.every_domain()) == [
        Stored(name, {"name": "a"}, "creating", uuid, ("0000:41:00.0",))
    ]
    kind.hv.undefine(name)  # nothing left to undefine
    kind.hv.stop(name)
    assert kind.hv.list(kind.prefix) == []
    assert kind.hv.metadata(name) is None


# -- nothing to do -----------------------------------------------------------------------------


def test_stop_and_shutdown_of_a_stopped_domain_succeed(kind: Kind) -> None:
    uuid = kind.define("a")
    name = kind.domain("a")
    kind.hv.stop(name)
    kind.hv.stop(name, uuid=uuid)
    kind.hv.shutdown(name)
    assert not kind.hv.running(name)
    assert kind.hv.list(kind.prefix) == [Stored(name, {"name": "a"}, "creating", uuid)]


def test_everything_of_an_absent_domain_that_may_succeed_does(kind: Kind) -> None:
    name = kind.domain("absent")
    kind.hv.stop(name)
    kind.hv.stop(name, uuid=str(uuids.uuid4()))
    kind.hv.shutdown(name)
    kind.hv.undefine(name)
    kind.hv.undefine(name, uuid=str(uuids.uuid4()))
    kind.hv.detach(name, hostdev(0x41))
    kind.hv.discard_save(name)
    assert kind.hv.running(name) is False
    assert kind.hv.saved(name) is None
    assert kind.hv.metadata(name) is None
    assert kind.hv.lease_address(name) is None


def test_detaching_a_device_not_attached_succeeds(on_fake: Kind) -> None:
    on_fake.define("a")
    on_fake.hv.detach(on_fake.domain("a"), hostdev(0x41))  # stopped
    on_fake.hv.start(on_fake.domain("a"))
    on_fake.hv.detach(on_fake.domain("a"), hostdev(0x41))  # running


def test_a_device_defined_at_boot_is_detached_from_the_running_guest(on_fake: Kind) -> None:
    """libvirt finds a host device to detach by its source address, whether it was attached
    live or is in the definition the guest booted with; a card's function cannot be taken
    from a slot it shares (libvirt 9.0)."""
    with_audio = (hostdev(0x41, guest_bus=2), hostdev(0x41, function=1, guest_bus=2))
    on_fake.define("a", hostdevs=(hostdev(0x42, guest_bus=1), *with_audio))
    name = on_fake.domain("a")
    on_fake.hv.start(name)
    on_fake.hv.detach(name, hostdev(0x42))  # found by its source: no guest address given
    assert hostdev_addresses(on_fake.hv.definition(name)) == ["0000:41:00.0", "0000:41:00.1"]
    with pytest.raises(FailedPrecondition, match="multifunction"):
        on_fake.hv.detach(name, hostdev(0x41))


# -- saved memory ------------------------------------------------------------------------------


def test_a_saved_domain_is_off_until_its_start_restores_it(kind: Kind) -> None:
    """Managed save: the memory kept by libvirt, the domain off and still defined with its
    record; start restores it (the save is gone then); a save can be discarded; undefine
    removes it with the domain."""
    uuid = kind.define("a", state="ready")
    name = kind.domain("a")
    with pytest.raises(FailedPrecondition):
        kind.hv.save(name)  # not running: nothing in memory to keep
    kind.hv.start(name)
    assert kind.hv.saved(name) is None
    kind.hv.save(name, uuid=uuid)
    assert not kind.hv.running(name)
    assert kind.hv.saved(name) is not None and kind.hv.saved(name, uuid=uuid) is not None
    assert kind.hv.stop_reason(name) == "its memory was saved to disk (suspended)"
    assert kind.hv.metadata(name) == Stored(name, {"name": "a"}, "ready", uuid)
    kind.hv.stop(name)  # off already: the save stays
    assert kind.hv.saved(name) is not None
    kind.hv.start(name, uuid=uuid)
    assert kind.hv.running(name) and kind.hv.saved(name) is None
    kind.hv.save(name)
    kind.hv.discard_save(name, uuid=uuid)
    assert kind.hv.saved(name) is None and not kind.hv.running(name)
    kind.hv.start(name)
    kind.hv.save(name)
    kind.hv.undefine(name)
    assert kind.hv.metadata(name) is None and kind.hv.saved(name) is None


def test_a_restored_domain_runs_with_the_record_stored_while_it_was_saved(kind: Kind) -> None:
    """The save holds the domain as it was when saved; what was stored since (a resume's GPUs,
    a lifetime extended) is what the restored domain answers with."""
    uuid = kind.define("a", state="ready")
    name = kind.domain("a")
    kind.hv.start(name)
    kind.hv.save(name, uuid=uuid)
    kind.hv.set_metadata(name, {"name": "a", "gpus": ["0000:41:00.0"]}, "resuming", uuid=uuid)
    kind.hv.start(name, uuid=uuid)
    assert kind.hv.running(name)
    expected = Stored(name, {"name": "a", "gpus": ["0000:41:00.0"]}, "resuming", uuid)
    assert kind.hv.metadata(name) == expected


def test_a_guest_holding_a_host_device_cannot_be_saved(on_fake: Kind) -> None:
    """QEMU cannot migrate a VFIO device (the test driver does not check): the device must be
    detached first, which a suspend does."""
    on_fake.define("gpu", hostdevs=(hostdev(0x41),))
    name = on_fake.domain("gpu")
    on_fake.hv.start(name)
    with pytest.raises(FailedPrecondition, match="host devices"):
        on_fake.hv.save(name)
    assert on_fake.hv.running(name)
    on_fake.hv.detach(name, hostdev(0x41))
    on_fake.hv.save(name)
    assert on_fake.hv.saved(name) is not None
    assert on_fake.hv.hostdev_holders() == {}


# -- running and stop_reason -------------------------------------------------------------------


def test_running_says_whether_it_runs(kind: Kind) -> None:
    kind.define("a")
    name = kind.domain("a")
    assert kind.hv.running(name) is False
    kind.hv.start(name)
    assert kind.hv.running(name) is True
    kind.hv.stop(name)
    assert kind.hv.running(name) is False
    assert kind.hv.running(kind.domain("absent")) is False


@pytest.mark.parametrize(
    ("how", "reason"),
    [("stop", "it was forced off (destroyed)"), ("shutdown", "the guest powered itself off")],
)
def test_stop_reason_says_why_it_stopped(kind: Kind, how: str, reason: str) -> None:
    """Both stand-ins power off at once on the ACPI button."""
    kind.define("a")
    name = kind.domain("a")
    kind.hv.start(name)
    assert isinstance(kind.hv.stop_reason(name), str)  # running: some words, no error
    getattr(kind.hv, how)(name)
    assert not kind.hv.running(name)
    assert kind.hv.stop_reason(name) == reason


def test_stop_reason_of_an_absent_domain_says_so_without_raising(kind: Kind) -> None:
    """It words an error the caller is raising (boot.py): it must not raise one of its own."""
    assert kind.hv.stop_reason(kind.domain("absent")).startswith("its state cannot be read")


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda hv, name: hv.start(name),
        lambda hv, name: hv.definition(name),
        lambda hv, name: hv.set_metadata(name, {"name": "x"}, "ready"),
        lambda hv, name: hv.attach(name, hostdev(0x41)),
        lambda hv, name: hv.save(name),
    ],
    ids=["start", "definition", "set_metadata", "attach", "save"],
)
def test_an_absent_domain_is_not_found(kind: Kind, call: Callable[[Any, str], object]) -> None:
    with pytest.raises(NotFound):
        call(kind.hv, kind.domain("absent"))


def test_starting_a_running_domain_is_refused(kind: Kind) -> None:
    kind.define("a")
    kind.hv.start(kind.domain("a"))
    with pytest.raises(FailedPrecondition):
        kind.hv.start(kind.domain("a"))
    assert kind.hv.running(kind.domain("a"))


# -- fail closed -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda hv, name: hv.every_domain(),
        lambda hv, name: hv.list("vmsbx-"),
        lambda hv, name: hv.running(name),
        lambda hv, name: hv.metadata(name),
        lambda hv, name: hv.hostdev_holders(),
        lambda hv, name: hv.definition(name),
        lambda hv, name: hv.start(name),
        lambda hv, name: hv.stop(name),
        lambda hv, name: hv.shutdown(name),
        lambda hv, name: hv.undefine(name),
        lambda hv, name: hv.detach(name, hostdev(0x41)),
        lambda hv, name: hv.set_metadata(name, {"name": "x"}, "ready"),
    ],
    ids=[
        *("every_domain", "list", "running", "metadata", "hostdev_holders", "definition"),
        *("start", "stop", "shutdown", "undefine", "detach", "set_metadata"),
    ],
)
def test_a_lost_connection_raises_unavailable(
    kind: Kind, call: Callable[[Any, str], object]
) -> None:
    """Never a shorter list, a guess ("not running"), or "nothing to do" for a domain that
    may well be there."""
    kind.define("a")
    kind.hv.start(kind.domain("a"))
    kind.lose_connection()
    with pytest.raises(Unavailable):
        call(kind.hv, kind.domain("a"))


def test_a_domain_unreadable_mid_listing_fails_the_listing(on_test_driver: Kind) -> None:
    """libvirtd goes away between listing the domains and reading one. libvirt only: the fake
    reads its domains in one go, so it has no such moment."""
    on_test_driver.define("a", hostdevs=(hostdev(0x41),))
    hv = on_test_driver.hv
    assert isinstance(hv, OnTestDriver)
    hv.lost = "mid listing"
    for call in (hv.every_domain, lambda: hv.list(on_test_driver.prefix), hv.hostdev_holders):
        with pytest.raises(Unavailable):
            call()


def test_stop_reason_lease_address_and_channel_state_answer_without_libvirt(kind: Kind) -> None:
    """They word an error or wait for an address or a channel: some words, or None, never an
    error."""
    kind.define("a")
    kind.hv.start(kind.domain("a"))
    kind.lose_connection()
    assert isinstance(kind.hv.stop_reason(kind.domain("a")), str)
    assert kind.hv.lease_address(kind.domain("a")) is None
    assert kind.hv.channel_state(kind.domain("a"), CHANNEL) is None


# -- the guest's end of a virtio channel ------------------------------------------------------

CHANNEL = "org.vmsandbox.control.0"
_CHANNEL_XML = (
    "<channel type='unix'><source mode='bind' path='/nonexistent/control.sock'/>"
    f"<target type='virtio' name='{CHANNEL}'/></channel>"
)


def test_a_channel_state_is_known_only_while_the_domain_runs(kind: Kind) -> None:
    """None for a domain that is off or absent, a channel it does not have, and a state the
    driver does not know; the fake reports what a test set, as the QEMU driver reports QEMU's."""
    name = kind.domain("a")
    kind.define("a", devices=(_CHANNEL_XML,))
    assert kind.hv.channel_state(name, CHANNEL) is None  # off
    kind.hv.start(name)
    assert kind.hv.channel_state(name, "org.example.other") is None
    assert kind.hv.channel_state(name, CHANNEL) is None  # the test driver knows no state
    assert kind.hv.channel_state(kind.domain("absent"), CHANNEL) is None
    if isinstance(kind.hv, FakeHypervisor):
        kind.hv.channels[name] = {CHANNEL: "connected"}
        assert kind.hv.channel_state(name, CHANNEL) == "connected"
        kind.hv.stop(name)
        assert kind.hv.channel_state(name, CHANNEL) is None


# -- host PCI devices --------------------------------------------------------------------------


def test_hostdevs_in_a_definition_are_held(kind: Kind) -> None:
    """Whether the domain runs or not: its definition takes them when it starts."""
    devices = (hostdev(0x41), hostdev(0x41, function=1))
    uuid = kind.define("gpu", hostdevs=devices)
    other = kind.define("plain")
    gpu, plain = kind.domain("gpu"), kind.domain("plain")
    held = ("0000:41:00.0", "0000:41:00.1")
    holders = kind.hv.hostdev_holders()
    assert {bdf: holders[bdf] for bdf in held} == dict.fromkeys(held, gpu)
    assert kind.mine(kind.hv.every_domain()) == [
        Stored(gpu, {"name": "gpu"}, "creating", uuid, held),
        Stored(plain, {"name": "plain"}, "creating", other),
    ]
    assert all(s.hostdevs == () for s in kind.hv.list(kind.prefix))  # every_domain's only
    kind.hv.start(gpu)
    assert kind.hv.hostdev_holders().get("0000:41:00.1") == gpu
    kind.hv.stop(gpu)
    kind.hv.undefine(gpu)
    assert "0000:41:00.0" not in kind.hv.hostdev_holders()


def test_an_attached_device_is_held_and_kept_after_a_stop(on_fake: Kind) -> None:
    """``attach`` adds to the running guest and to its definition: a stopped and restarted
    sandbox keeps it; ``detach`` takes it from both."""
    on_fake.define("a")
    name = on_fake.domain("a")
    with pytest.raises(FailedPrecondition):
        on_fake.hv.attach(name, hostdev(0x42))  # not running
    on_fake.hv.start(name)
    on_fake.hv.attach(name, hostdev(0x42))
    assert on_fake.hv.hostdev_holders() == {"0000:42:00.0": name}
    on_fake.hv.stop(name)
    assert on_fake.hv.hostdev_holders() == {"0000:42:00.0": name}
    assert hostdev_addresses(on_fake.hv.definition(name)) == ["0000:42:00.0"]
    on_fake.hv.start(name)
    on_fake.hv.attach(name, hostdev(0x43))
    assert hostdev_addresses(on_fake.hv.definition(name)) == ["0000:42:00.0", "0000:43:00.0"]
    on_fake.hv.detach(name, hostdev(0x43))
    assert on_fake.hv.hostdev_holders() == {"0000:42:00.0": name}
    assert hostdev_addresses(on_fake.hv.definition(name)) == ["0000:42:00.0"]


# -- the connection ----------------------------------------------------------------------------


def test_close_can_be_called_twice_and_the_hypervisor_reconnects(kind: Kind) -> None:
    uuid = kind.define("a")
    kind.hv.close()
    kind.hv.close()
    assert [s.uuid for s in kind.hv.list(kind.prefix)] == [uuid]
