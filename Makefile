# The two commands a newcomer needs: `make demo` and `make test`. Both run the setup first
# (idempotent: packages, libvirtd, virtualenv, guest images).
.PHONY: setup demo test lint bench docs

setup:
	bash setup/setup.sh

demo: setup
	bash setup/demo.sh

# The test run needs all three images: the NVIDIA one is booted by its own e2e test, and the
# nested GPU host (tests/test_e2e_nested.py, through setup/nested.sh) by the real-VFIO tests.
# setup/platforms.sh builds .venv-platforms, the platforms' own released packages that
# tests/test_compat_platforms.py compares vmsandbox.compat with and tests/test_openshell_sdk.py
# drives the OpenShell driver with.
test:
	VMSANDBOX_IMAGES="minimal nvidia nested" bash setup/setup.sh
	bash setup/platforms.sh
	.venv/bin/ruff check vmsandbox tests bench docs
	.venv/bin/ruff format --check vmsandbox tests bench docs
	.venv/bin/pytest -p no:cacheprovider -ra tests

lint:
	.venv/bin/ruff check vmsandbox tests bench docs
	.venv/bin/ruff format --check vmsandbox tests bench docs

bench:
	VMSANDBOX_EXTRA_PACKAGES=virtinst bash setup/setup.sh
	.venv/bin/python bench/run_all.py

# The compatibility page is generated from vmsandbox/compat/fields/.
docs:
	.venv/bin/python docs/gen_compat.py
