"""Suite-wide settings."""

import os

from tests.launchers import UNSHARED_STORE_VAR

# every launch inherits the suite's environment: torchrun must share its store with its ranks,
# never hand them a port picked free (tests/launchers.py)
os.environ.pop(UNSHARED_STORE_VAR, None)

try:  # the policy-core and simulator tests run without torch (`pytest -m "not distributed"`)
    import torch
except ImportError:
    torch = None

if torch is not None:
    # The test matrices are tiny: on this 2-core machine one thread is several times faster than
    # two, and it keeps CPU reductions in one order run to run.
    torch.set_num_threads(1)
