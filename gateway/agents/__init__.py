"""Agents (the offline `echo` default, any OpenAI-compatible endpoint), their tools and tool processes."""
