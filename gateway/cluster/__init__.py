"""Cluster coordination: session ownership, forwarding between workers, ingress leaders."""
