"""Training frameworks driving canzona's `DistributedOptimizer` with their usual loops.

- `canzona.integrations.accelerate`: `CanzonaAccelerator`, an `accelerate.Accelerator` for models
  whose parameters a canzona optimizer holds (no DDP, no copying move, clipping and accumulation
  through the optimizer, sharded checkpoints in `save_state` / `load_state`);
- `canzona.integrations.hf`: `CanzonaTrainer`, a `transformers.Trainer` on that accelerator that
  builds (or takes) the optimizer, clips and logs the global norm of the reduced gradients and
  checkpoints the optimizer sharded, on every rank.

Each module imports its framework when imported itself; `import canzona` needs neither.
"""
