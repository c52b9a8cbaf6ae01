"""What a piece of runtime code allocates, measured from the outside: every tensor an operator
creates with storage of its own, whatever the code's own bookkeeping says.

`Comm.peak_in_flight_bytes` counts the buffers the runtime hands to `Comm._holding`; a buffer it
allocates and forgets to hand over (a receive buffer, say) would escape that count, and the memory
parity tests would still pass. `Allocations` sees it: a `TorchDispatchMode` that adds up the bytes
of each operator output whose storage is none of its inputs' (a view, a slice, an alias or an
in-place result shares its input's storage; `empty`, `zeros`, `clone` do not). Operators run inside
an operator (a backend's own copies, such as gloo's clone of a reduce-scatter's input) are not
seen: the mode is off while its operator runs, and they are the backend's, not the caller's.
"""

from __future__ import annotations

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storages(tree) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_leaves(tree) if isinstance(t, Tensor)}


class Allocations(TorchDispatchMode):
    """`with Allocations() as seen:` ... then `seen.bytes`: the bytes of the new storages
    created under it (each counted once), and `seen.sizes` their sizes in order."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    @property
    def bytes(self) -> int:
        return sum(self.sizes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        known = _storages((args, kwargs))
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and t.untyped_storage().nbytes():
                ptr = t.untyped_storage().data_ptr()
                if ptr not in known:
                    known.add(ptr)
                    self.sizes.append(t.untyped_storage().nbytes())
        return out


def metered(comm) -> Allocations:
    """Measure what `comm` (a `canzona.runtime.comm.Comm`) allocates while it issues its
    reduce-scatters, from here on: the returned `Allocations` adds up every call's."""
    seen, issue = Allocations(), comm.reduce_scatter_v

    def reduce_scatter_v(*args, **kwargs):
        with seen:
            return issue(*args, **kwargs)

    comm.reduce_scatter_v = reduce_scatter_v
    return seen
