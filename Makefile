# The two commands a newcomer needs: `make demo` and `make test`. Both run the setup first
# (idempotent: packages, libvirtd, virtualenv, guest images).
.PHONY: setup demo test lint bench docs

# The documentation's tools live in a virtualenv of their own, pinned by docs/requirements.txt.
DOCS_VENV ?= .venv-docs

setup:
	bash setup/setup.sh

demo: setup
	bash setup/demo.sh

# The test run needs all three images: the NVIDIA one is booted by its own e2e test, and the
# nested GPU host (tests/test_e2e_nested.py, through setup/nested.sh) by the real-VFIO tests.
# The docs build comes before the suite: a broken link or a stale reference fails it at once.
test:
	VMSANDBOX_IMAGES="minimal nvidia nested" bash setup/setup.sh
	.venv/bin/ruff check vmsandbox tests bench docs
	.venv/bin/ruff format --check vmsandbox tests bench docs
	$(MAKE) docs
	VMSANDBOX_DOCS_VENV=$(DOCS_VENV) .venv/bin/pytest -p no:cacheprovider -ra tests

lint:
	.venv/bin/ruff check vmsandbox tests bench docs
	.venv/bin/ruff format --check vmsandbox tests bench docs

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
