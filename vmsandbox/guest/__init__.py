"""Talking to a guest: SSH with its pinned host key (``ssh``), the per-sandbox key pairs (``keys``),
the NoCloud seed (``seed``) and the guest setup it carries (``setup``), the host end of the control
channel (``control``), commands as scripts need them (``execute``), files in and out over SFTP
(``transfer``, with ``upload``, ``download``, the SFTP session ``sftpipe`` and the local folder a
download writes into, ``localdir``), TCP ports forwarded to this host (``forward``), OpenSSH's
command line and ssh_config stanzas (``openssh``), the GPU checks run inside a booted guest
(``verify``), a GPU hand-over inside the guest around a suspend (``quiesce``), and the programs that
images and checks ship into guests (``programs``: standard library only, run there, never imported
by the rest of vmsandbox).

Imports: ``gpu``, ``vm``, ``host`` and the shared core only.
"""
