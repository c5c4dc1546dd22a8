"""What a run needs around the training itself: SIGTERM and Ctrl-C (:mod:`.sigterm`), checkpoints that cannot be
half-written (:mod:`.atomic_checkpoint`) and the diagnosis of a ``--ckpt_path`` (:mod:`.checkpoint_check`), the
console lines (:mod:`.console`), torch's thread count (:mod:`.threads`), phase timers (:mod:`.timing`), the working
directory on ``sys.path`` (:mod:`.importpath`) and worker processes with per-call timeouts (:mod:`.workers`).

Nothing is re-exported: import from the module, e.g. ``from rloo_lightning.runtime.sigterm import check``.
"""
