"""Integrations with model runtimes (torch required; transformers for all but torch_hook):

  kvshade.integrations.torch_hook   KvShadeKVCache, a plain-torch attention hook
  kvshade.integrations.hf_cache     a transformers cache and attention over kvshade
    .hf_model                       its model's ModelSpec and RoPE checks (re-exported there)
    .hf_ingest                      the prefill's layer senders (host path, same node)
  kvshade.integrations.serving      Generator: continuous batching of long sequences
  kvshade.integrations.hf_batching  transformers' own continuous batching over kvshade

Each is imported by its module; nothing is imported here.
"""
