"""Suite-wide settings."""

try:  # the policy-core and simulator tests run without torch (`pytest -m "not distributed"`)
    import torch
except ImportError:
    torch = None

if torch is not None:
    # The test matrices are tiny: on this 2-core machine one thread is several times faster than
    # two, and it keeps CPU reductions in one order run to run.
    torch.set_num_threads(1)
