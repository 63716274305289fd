# The two commands a newcomer needs: `make demo` and `make test`. Both run the setup first
# (idempotent: packages, libvirtd, virtualenv, guest images).
.PHONY: setup demo check test chaos lint typecheck bench docs pages

# The documentation's tools live in a virtualenv of their own, pinned by docs/requirements.txt.
DOCS_VENV ?= .venv-docs

setup:
	bash setup/setup.sh

demo: setup
	bash setup/demo.sh

# The loop to run after every edit (about a minute here): lint, types and the unit tests, which
# need nothing but a set-up checkout (no libvirtd, no guest). `make test` runs everything.
check: $(DOCS_VENV)/.installed lint typecheck
	VMSANDBOX_DOCS_VENV=$(DOCS_VENV) .venv/bin/pytest -p no:cacheprovider -q tests/unit

# The whole suite on a fresh machine. It needs all three images: the NVIDIA one is booted by its
# own e2e test, and the nested GPU host (tests/e2e/test_nested.py, through setup/nested.sh) by
# the real-VFIO tests. setup/platforms.sh builds .venv-platforms, the platforms' own released
# packages that tests/unit/compat/test_compat_platforms.py compares vmsandbox.compat with and
# tests/unit/openshell/test_request_sdk.py drives the OpenShell driver with. The docs build
# comes before the suite: a broken link or a stale reference fails it at once. The chaos module
# (tests/reliability/test_chaos.py: libvirtd restarts, killed servers, eight clients for two
# minutes, about 5 minutes) is part of the suite; `make chaos` runs it alone.
test:
	VMSANDBOX_IMAGES="minimal nvidia nested" bash setup/setup.sh
	bash setup/platforms.sh
	$(MAKE) lint typecheck docs
	VMSANDBOX_DOCS_VENV=$(DOCS_VENV) .venv/bin/pytest -p no:cacheprovider -ra tests

chaos: setup
	.venv/bin/pytest -p no:cacheprovider -ra tests/reliability/test_chaos.py

lint:
	.venv/bin/ruff check vmsandbox tests bench docs setup
	.venv/bin/ruff format --check vmsandbox tests bench docs setup

# mypy with pyproject.toml's [tool.mypy]: strict for host, gpu, vm and sandbox.
typecheck:
	.venv/bin/mypy

bench:
	VMSANDBOX_EXTRA_PACKAGES=virtinst bash setup/setup.sh
	.venv/bin/python bench/run_all.py

# The site, into site/, with warnings as errors; nothing is fetched while it builds.
docs: $(DOCS_VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict --site-dir site

$(DOCS_VENV)/.installed: docs/requirements.txt
	python3 -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/pip install -q --disable-pip-version-check -r docs/requirements.txt
	touch $@

# The generated pages, written again from their sources (the tests check they are current):
# compatibility from vmsandbox/compat/fields/, performance from the reports in docs/results/.
pages:
	.venv/bin/python docs/gen_compat.py
	.venv/bin/python docs/gen_performance.py
