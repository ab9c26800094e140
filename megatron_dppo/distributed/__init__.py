"""The process layer: who runs where and how processes talk. ``launch.py`` (rank, world and rendezvous from
torchrun, srun or mpirun), ``collectives.py`` (the small collective helpers every layer uses: broadcast, gather,
``map_sharded``, derived seeds), ``launch_check.py`` (a tiny distributed self-test of a launch), ``spawn.py`` (a
function on N fresh local processes forming one gloo world: the engine tests' and benchmarks' harness), and for
``rollout.placement=separate`` the trainer / rollout-worker layout: ``placement.py`` (roles, each side's group, the
links), ``transfer.py`` (versioned weights and batches between the sides), ``staleness.py`` (the bound on how old
the weights that generate a batch may be). Imports nothing else of the package."""
