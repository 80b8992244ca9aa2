"""What an engine's weight version can say.

A receiver's ``version`` is one of:

* ``None``: nothing applied yet (or an actor restarted by Ray that has not been pushed to since);
* an ``int``: the destinations hold exactly the bytes of that version, nothing else;
* ``MIXED``: a push failed after some of its bytes had reached the destinations (or an engine's reload
  failed and could not be undone), so the weights are a mix that no trainer ever had. An engine whose version
  is ``MIXED`` is no version: the next push is a full one (it never compares equal to a version, so it is
  never skipped) and repairs it.

# Note [versions never lie]
# A receiver sets ``version`` to MIXED before the first byte of a non-atomic push reaches a destination and
# to the pushed version only after the last one landed (and was verified, where SyncConfig.verify asks), so
# a failure at any point between leaves MIXED behind. Atomic configurations (a staged sink whose apply copies
# are the last step, vLLM's staged CPU reload that is restored on failure) keep the old version on failure.
# A staged push (``receive(flip=False)``, raysync.core.staging) never writes the live weights: only the engine's
# ``flip()`` does, and only it changes ``version``; the push waiting for it is ``staged_version``, reported
# apart (Note [flip and versions]).
"""

from __future__ import annotations

from typing import Literal, TypeAlias

MIXED: Literal["mixed"] = "mixed"

Version: TypeAlias = "int | None | Literal['mixed']"


def is_version(value: object) -> bool:
    """True when ``value`` names exactly one version's weights (an int, never MIXED or None)."""
    return isinstance(value, int) and not isinstance(value, bool)
