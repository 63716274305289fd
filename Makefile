# The two commands a newcomer needs: `make demo` and `make test`. Both run the setup first
# (idempotent: packages, libvirtd, virtualenv, guest images).
.PHONY: setup demo test lint bench

setup:
	bash setup/setup.sh

demo: setup
	bash setup/demo.sh

# The test run needs all three images: the NVIDIA one is booted by its own e2e test, and the
# nested GPU host (tests/test_e2e_nested.py, through setup/nested.sh) by the real-VFIO tests.
# Other platforms' SDKs (the openshell SDK for tests/test_openshell_sdk.py) get a venv of their
# own: setup/platforms.sh.
test:
	VMSANDBOX_IMAGES="minimal nvidia nested" bash setup/setup.sh
	bash setup/platforms.sh
	.venv/bin/ruff check vmsandbox tests bench
	.venv/bin/ruff format --check vmsandbox tests bench
	.venv/bin/pytest -p no:cacheprovider -ra tests

lint:
	.venv/bin/ruff check vmsandbox tests bench
	.venv/bin/ruff format --check vmsandbox tests bench

bench:
	VMSANDBOX_EXTRA_PACKAGES=virtinst bash setup/setup.sh
	.venv/bin/python bench/run_all.py
