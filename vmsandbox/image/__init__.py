"""Base images: the store under the image directory (``store``), recipes (``recipe``) and how one
becomes a build (``build``, with the host's apt mirrors from ``apt_sources``), the checks of an
imported disk (``check``), an import that would replace what a name is now (``replacing``) and
which sandboxes use which build (``users``).

Imports: ``guest`` (the programs a recipe installs), ``gpu``, ``vm``, ``host`` and the shared
core only.
"""
