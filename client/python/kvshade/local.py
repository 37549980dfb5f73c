"""Former path of kvshade.decoders.local, kept as an alias: the same module object."""
import sys

from .decoders import local as _module

sys.modules[__name__] = _module
