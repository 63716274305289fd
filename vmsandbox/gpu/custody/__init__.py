"""GPU custody between tenants: every GPU has a state the host keeps in its own records, a GPU
is handed to the next tenant only after it was reset, checked and cleared, and a sick GPU is
kept out until it is well again.

One module per concept:

- ``state``: the states (free, assigned, sanitizing, suspect, quarantined, resetting, failed),
  a GPU's ``Custody`` record, the pure transitions between them, and ``with_custody``, which
  gives the inventory each GPU's state for the allocator;
- ``store``: the records in the state directory, written atomically under the host lock, and
  the logs of changes and sanitizes;
- ``sanitize``: the steps between two tenants (partition check, unbind, reset, alive, memory
  clear, scrub hook, rebind), each timed;
- ``work``: the transitions at work: GPUs assigned and released under the lock, sanitized,
  reset and checked outside it, and the operator's check and forced release;
- ``signals``: health signals (config space, AER, a domain paused on an error, Xids) as what
  they do to a GPU; ``xid``: NVIDIA's Xid catalogue sorted into application, reset and reboot
  faults.

The monitor that gathers the signals and reports a quarantined GPU's sandbox as failed is the
sandbox layer's (``vmsandbox.sandbox.health``); the host reads and writes are
``vmsandbox.host``'s (``pcistate``, ``pcireset``, ``nvclear``, ``kernlog``, ``aer``).

Imports: ``vm``, ``host``, the rest of ``gpu`` and the shared core only.
"""
