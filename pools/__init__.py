"""KV-cache and Mamba-state memory pools, allocators and post-capture backing."""
