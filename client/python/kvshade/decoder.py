"""Former path of kvshade.decoders.base, kept as an alias: the same module object."""
import sys

from .decoders import base as _module

sys.modules[__name__] = _module
