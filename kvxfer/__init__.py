"""kvxfer: KV-cache transfer for disaggregated LLM serving."""
__version__ = "0.1.0"
