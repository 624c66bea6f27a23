"""Switchboard: connects LLM agents to the chat platforms people already use."""

__version__ = "0.1.0"
