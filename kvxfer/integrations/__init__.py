"""Integrations of kvxfer with serving engines. Each lives in its own subpackage and imports
its engine only when used: ``kvxfer.integrations.sglang`` (SGLang transfer backend)."""
