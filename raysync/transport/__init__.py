"""Transports move bucket bytes; the control channel (raysync.control) says when. See registry.py."""
