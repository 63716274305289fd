"""Programs that run inside guests, not in vmsandbox: the first-boot unit (``firstboot``, with its
modules ``firstboot_seed`` and ``firstboot_iso``) and the control channel's server (``control``),
which image recipes install (their key ``guest_tools``), and the CUDA smoke test (``cuda_smoke``)
that verification feeds to ``python3`` over SSH, and the GPU hand-over around a suspend
(``gpu_quiesce``: CUDA processes checkpointed, the driver unloaded, and back).

Standard library only. The rest of vmsandbox never imports them: they are package data to it
(the tests import them to run them on the host).
"""
