"""Packaged data: the sample agent trace."""
