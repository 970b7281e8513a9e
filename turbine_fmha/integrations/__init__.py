"""Integrations with other frameworks, each an optional extra.

Importing this package imports none of them: `turbine_fmha.integrations.
transformers` needs Hugging Face transformers (`pip install
turbine-fmha[transformers]`) and is imported only when asked for.
"""
