"""Talking to a guest: SSH with its pinned host key (``ssh``), the per-sandbox key pairs
(``keys``), the NoCloud seed (``seed``) and the guest setup it carries (``setup``), the host end
of the control channel (``control``), the GPU checks run inside a booted guest (``verify``), and
the programs that images and checks ship into guests (``programs``: standard library only, run
there, never imported by the rest of vmsandbox).

Imports: ``gpu``, ``vm``, ``host`` and the shared core only.
"""
