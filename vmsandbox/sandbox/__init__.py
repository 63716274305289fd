"""A sandbox's life: what a caller asks for (``spec``), the plan of its domain (``plan``), its
record and files (``record``) kept in libvirt (``store``), the create steps and their undos
(``lifecycle``), the boot wait (``boot``), stop and start (``power``), repair (``reconcile``),
the warm pool (``pool``, ``warmpool``, and ``gpuclaim`` for GPU sandboxes), secrets kept as
digests (``credential``), the handle a caller gets (``handle``: ``Sandbox``) and
``SandboxManager`` (``manager``), which orchestrates them.

Imports: ``image``, ``guest``, ``gpu``, ``vm``, ``host`` and the shared core; never the faces.
"""
