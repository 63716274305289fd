"""What happens to the host's GPUs: the request grammar (``request``: ``GpuRequest``), the choice
of GPUs (``allocator``; on NVSwitch boards ``fabric``, whose ``policy.allocate`` is the entry
point of every allocation), the hostdev XML and firmware of passthrough (``passthrough``), spare
root ports and live attach (``hotplug``), what a sandbox remembers of each GPU (``record``), and
how many sandboxes of each GPU count the host can still place (``capacity``, for the fleet),
and each GPU's custody between tenants (``custody``: its state, the sanitize between two
tenants, health signals, quarantine).

Imports: ``vm``, ``host`` and the shared core only.
"""
