"""What happens to the host's GPUs: the request grammar (``request``: ``GpuRequest``), the choice
of GPUs (``allocator``; on NVSwitch boards ``fabric``, whose ``policy.allocate`` is the entry
point of every allocation), the hostdev XML and firmware of passthrough (``passthrough``), spare
root ports and live attach (``hotplug``), and what a sandbox remembers of each GPU (``record``).

Imports: ``vm``, ``host`` and the shared core only.
"""
