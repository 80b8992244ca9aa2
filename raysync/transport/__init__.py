"""Transports move bucket bytes; the control channel (raysync.core.control) says when. See registry.py."""
