"""libvirt and QEMU: the hypervisor seam (``hypervisor``: the ``Hypervisor`` protocol and its
libvirt implementation; ``connection``: the libvirt connection and its errors as our error
codes), a sandbox's domain XML (``domain``), the virt type (``virt``: KVM where
it really runs guests, else TCG), the identity of a process that survives its pid being reused
(``process``), what a guest's serial console says about its boot (``console``), the rule
that keeps guests off the host's own addresses, checked before every start (``netguard``), and
the domains a device's fault paused (``faults``).

Imports: ``host`` and the shared core only; gpu, guest, image and sandbox build on this package.
"""
