"""What the test run targets, read once (tests/conftest.py puts this folder on sys.path).

``DEVICE``: the torch device of the tests' pools, buffers and kernels: ``KVXFER_TEST_DEVICE``
("cuda" on the accelerator machine), default "cpu".
"""

import os

DEVICE: str = os.environ.get("KVXFER_TEST_DEVICE", "cpu")
