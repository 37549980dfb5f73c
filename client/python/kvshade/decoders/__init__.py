"""Decoders: what a model runtime drives, layer by layer, to decode a batch of sequences
over kvshade sessions.

  kvshade.decoders.base    the Decoder protocol (also kvshade.Decoder)
  kvshade.decoders.local   LocalDecoder: same node, no RPC per step (needs torch)
  kvshade.decoders.remote  RemoteDecoder: the data path, one select per layer (needs torch)

The implementations are imported by their modules (torch is optional for the package).
"""
from .base import Decoder

__all__ = ["Decoder"]
