"""Former path of kvshade.decoders.remote, kept as an alias: the same module object."""
import sys

from .decoders import remote as _module

sys.modules[__name__] = _module
