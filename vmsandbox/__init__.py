"""vmsandbox: libvirt VM sandboxes with PCI GPU passthrough."""

__version__ = "0.1.0"
