"""Former path of kvshade.integrations.hf_cache, kept as an alias: the same module object."""
import sys

from .integrations import hf_cache as _module

sys.modules[__name__] = _module
