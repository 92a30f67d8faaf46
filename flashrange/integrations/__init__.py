"""Integrations of flashrange with other libraries.

Nothing here is imported by ``import flashrange``: each integration is a
submodule that imports its library only when you import it, e.g.
:mod:`flashrange.integrations.transformers` (Hugging Face ``transformers``).
"""
