"""A sandbox's life: what a caller asks for (``spec``), the plan of its domain (``plan``), its
record and files (``record``) kept in libvirt (``store``), what each sandbox holds of the host
(``holds``: reservations written under the host lock) and how a call reserves it (``reserve``), the
create steps and their undos (``create``), how steps run (``runner``) and where their time went
(``timing``), a create that makes nothing (``dryrun``), the boot wait (``boot``), stop and start
(``power``), using a running sandbox (``access``: commands, files, ports, OpenSSH, the console),
lifetimes (``lifetime``, their times in ``expiry``), states kept true after their call is gone
(``settle``), destroy (``teardown``), suspend and resume (``suspend``, ``resume``, the GPUs a resume
takes in ``resume_gpus``, what a suspended sandbox keeps in ``suspension`` and its GPUs handed over
in ``handover``), repair (``reconcile``), its GPUs' custody between tenants (``custody``: released
GPUs sanitized before anyone takes them again; ``health``: the monitor that quarantines a sick GPU
and fails its sandbox), the warm pool (the ``pool`` package: its shapes, its fill and claim steps,
the GPU claim's steps and the pool at work; its ``__init__`` is the map), secrets kept as digests
(``credential``), the handle a caller gets (``handle``: ``Sandbox``) and ``SandboxManager``
(``manager``), which orchestrates them.

Imports: ``image``, ``guest``, ``gpu``, ``vm``, ``host`` and the shared core; never the faces.
"""
