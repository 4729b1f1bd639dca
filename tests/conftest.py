"""Suite-wide plugins: the skip policy (tests/skip_policy.py)."""

pytest_plugins = ["tests.skip_policy"]
