"""Former path of kvshade.integrations.serving, kept as an alias: the same module object."""
import sys

from .integrations import serving as _module

sys.modules[__name__] = _module
