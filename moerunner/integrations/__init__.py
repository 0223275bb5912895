"""Integrations of moerunner into other libraries.

``moerunner.integrations.transformers``: moerunner as a HuggingFace transformers 5 experts
implementation (``experts_implementation="moerunner"``). Importing it registers the name.
"""
