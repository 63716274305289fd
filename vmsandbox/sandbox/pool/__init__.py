"""The warm pool: booted guests kept ready so that a create only has to claim one.

Modules: ``shapes`` (what a shape is and the ``[pool]`` table's rules: which create a shape
serves, which guest it holds, the names kept for pooled guests), ``steps`` (``FILL_STEPS``,
``CLAIM_STEPS`` and ``GPU_CLAIM_STEPS``: making a pooled guest and claiming one, as create
steps with their undos), ``gpu_steps`` (the GPU claim's own steps: GPUs attached live to a
pooled guest, seen and verified), ``park`` (a ``park`` shape's guests saved to disk while
they wait, and restored by a claim), ``keeper`` (``WarmPool``: the pool at work for one manager,
filling, claiming, showing and draining it).

Nothing is imported here, so that a reader of ``shapes`` alone (``openshell.request``) loads
none of the create path.
"""
