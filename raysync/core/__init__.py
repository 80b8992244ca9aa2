"""The core: one push, from source to sink, whatever moves the bytes.

Read in the order of the data flow:
    source.py (what to send: select, cast, pack) -> plan.py (layout bounds, buckets) -> session.py (the sender's
    stages) -> [a data plane: raysync.transport] -> session_receiver.py (the receiver's stages) -> sink.py (where
    the bytes land: tensors, a load function, staging) and copies.py (the batched unpack)
Around them: wire.py (the signed messages), control.py (the control channel: one sender, N receivers),
version.py (Note [versions never lie]), digest.py (verify), report.py, config.py, errors.py (every error
type), leftovers.py (names that outlive a crash), sender.py / receiver.py (WeightSender / WeightReceiver).
"""
