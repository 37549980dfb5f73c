"""Former path of kvshade.integrations.torch_hook, kept as an alias: the same module object."""
import sys

from .integrations import torch_hook as _module

sys.modules[__name__] = _module
