"""The steering view: vector helpers and the Panel component."""
