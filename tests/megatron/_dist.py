"""The engine tests' process harness, from the library (the benchmarks use the same):
``run_distributed`` (a function on N fresh processes forming one gloo world, ``megatron_dppo.distributed.spawn``)
and ``single_process_world`` (a world of one inside this process, ``megatron_dppo.megatron.parallel``).

    from _dist import run_distributed
    results = run_distributed(my_worker, world_size=2, args=(tmp_path, 3), timeout=180)
"""
from megatron_dppo.distributed.launch import free_port
from megatron_dppo.distributed.spawn import run_distributed
from megatron_dppo.megatron.parallel import single_process_world

__all__ = ["free_port", "run_distributed", "single_process_world"]
