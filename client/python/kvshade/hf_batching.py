"""Former path of kvshade.integrations.hf_batching, kept as an alias: the same module object."""
import sys

from .integrations import hf_batching as _module

sys.modules[__name__] = _module
