"""A run on disk and across stops: its directory, its checkpoints, exact resume and the stop signals.

- :mod:`.rundir`: the run directory (layout, lock, which checkpoint, the resume policy) and
  :class:`~ppokit.persistence.rundir.RunDir`, through which every command reads a run;
- :mod:`.checkpoint`: checkpoints as safetensors and JSON, nothing pickled; sharded ones;
- :mod:`.checkpoint_files`: the completion marker, atomic directory writes and a killed writer's
  leftovers, without torch (a run directory is read light);
- :mod:`.resume`: RNG capture and seeding, the graceful stop, the bad-step guard;
- :mod:`.signals`: SIGINT/SIGTERM handlers installed for a block and put back after it.
"""
