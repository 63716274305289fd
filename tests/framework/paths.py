"""Where things are: the checkout, the test tree and its fixtures, whatever a test's own depth."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
GOLDEN = TESTS / "golden"
FRAMEWORK = TESTS / "framework"
