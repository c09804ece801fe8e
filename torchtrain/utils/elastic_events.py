"""torchrun's rendezvous events, named without reading source files.

torch's dynamic rendezvous names each event it records after the method that recorded it, found with
`inspect.stack()`: that call reads the source lines of every frame on the stack from disk (twice per event,
dozens of events per rendezvous), about 0.1-0.3 s of CPU per launch, more than the rest of the rendezvous
on a small machine. `install()` swaps in a lookup of the same frame's function name (`sys._getframe`), which
gives the same name for the same call; the events and their handlers are otherwise unchanged.
"""

from __future__ import annotations

import sys


def method_name(depth: int = 2) -> str:
    """The name of the function `depth` frames above this one (torch's `get_method_name` contract)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is shallower than that
        return "no_method_name"


def install() -> None:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    dynamic_rendezvous.get_method_name = method_name
