"""Hugging Face ``transformers`` export of a trained model, and the code shipped inside it.

``configuration_attnres.py`` and ``modeling_attnres.py`` are copied into every export (they
import torch and transformers only); ``weights.py`` maps parameter names, ``tokenizer.py``
writes the tokenizer files and ``writer.py`` the directory. Importing this package imports
nothing heavy.
"""
