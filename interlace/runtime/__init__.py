"""Host side: groups, symmetric buffers, signal pads, comm streams, copy-engine transfers."""

from . import graphs
from .group import Group, interpreter_enabled
from .signals import (
    ErrorWord,
    SignalPad,
    abort_open_calls,
    default_max_spins,
    default_wait_bound_us,
)
from .streams import (
    comm_stream,
    copy_and_signal,
    fork,
    fork_from_mark,
    fork_mark,
    join,
    stream_write_value32,
    use_stream,
)
from .symmetric import SymmetricTensor, symm_empty, symm_zeros

__all__ = [
    "ErrorWord",
    "Group",
    "SignalPad",
    "SymmetricTensor",
    "abort_open_calls",
    "comm_stream",
    "copy_and_signal",
    "default_max_spins",
    "default_wait_bound_us",
    "fork",
    "fork_from_mark",
    "fork_mark",
    "graphs",
    "interpreter_enabled",
    "join",
    "stream_write_value32",
    "symm_empty",
    "symm_zeros",
    "use_stream",
]
