"""Distributed checkpoints: save, find, verify and resume (``manager``), the training state as
DCP keys and back (``training_state``), checkpoint files and manifests (``files``), which run
a checkpoint belongs to (``run_identity``), the DCP calls and their failures (``dcp_io``,
imported at the first save or load) and reading DCP metadata without running code from it
(``safe_dcp``). ``errors.CheckpointError`` is the one error of them all.
"""
