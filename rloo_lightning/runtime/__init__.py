"""What a run needs around the training itself: SIGTERM and Ctrl-C (:mod:`.sigterm`), checkpoints that cannot be
half-written (:mod:`.atomic_checkpoint`) and the diagnosis of a ``--ckpt_path`` (:mod:`.checkpoint_check`), the
console lines (:mod:`.console`), torch's thread count (:mod:`.threads`), phase timers (:mod:`.timing`), the working
directory on ``sys.path`` (:mod:`.importpath`), worker processes with per-call timeouts (:mod:`.workers`), and a
run's TensorBoard scalars read back (:mod:`.tensorboard_logs`, for tests, benchmarks and studies). Every private API
of Lightning, LightningCLI, jsonargparse, TensorBoard, torch and the like that the package uses goes through
:mod:`.framework`, the one place to mend on an upgrade.

Nothing is re-exported: import from the module, e.g. ``from rloo_lightning.runtime.sigterm import check``.
"""
