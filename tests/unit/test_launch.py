"""megatron_dppo.distributed.launch on environment dicts (no processes, no Slurm needed).

The Slurm / Open MPI environments below are trimmed copies of what the local Slurm 22.05 cluster
(.ci/slurm_cluster.sh) actually exported: a 2-node x 2-task job, its batch script, an srun step, an
`srun --mpi=pmix` step and `mpirun -np 4` inside the allocation.
"""
from __future__ import annotations

import pytest

from megatron_dppo.distributed.launch import (
    LaunchError,
    LaunchInfo,
    check_single_world,
    discover_launch,
    expand_slurm_nodelist,
    free_port,
    parse_slurm_nodelist,
    parse_slurm_tasks_per_node,
    slurm_master_port,
)

# --- measured on Slurm 22.05: `sbatch --nodes=2 --ntasks-per-node=2 --gres=gpu:2`, job id 1
SLURM_JOB = {
    "SLURM_JOB_ID": "1", "SLURM_JOBID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODELIST": "n[1-2]",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4",
    "SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2(x2)", "CUDA_VISIBLE_DEVICES": "0,1",
}
# the batch script itself: SLURM_PROCID=0 but no SLURM_STEP_ID
BATCH_STEP = {**SLURM_JOB, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_GTIDS": "0"}


def srun_task(procid: int) -> dict[str, str]:
    """Task `procid` of `srun` (step 0) in that job: tasks 0,1 on n1, 2,3 on n2."""
    node = procid // 2
    return {**SLURM_JOB, "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid % 2), "SLURM_NODEID": str(node),
            "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
            "SLURM_GTIDS": f"{2 * node},{2 * node + 1}", "SLURMD_NODENAME": f"n{node + 1}"}


def mpirun_rank(rank: int) -> dict[str, str]:
    """`mpirun -np 4` in the batch script: ranks inherit the SLURM_* of mpirun's daemon step (1 task per node)."""
    node = rank // 2
    return {**SLURM_JOB, "SLURM_PROCID": str(node), "SLURM_LOCALID": "0", "SLURM_NODEID": str(node),
            "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_STEP_NUM_TASKS": "2",
            "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % 2),
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": str(rank % 2), "PMIX_RANK": str(rank)}


def discover(env: dict[str, str], **kw) -> LaunchInfo:
    """discover_launch on a copy, without scontrol (parsed in Python) and without mpi4py."""
    return discover_launch(dict(env), use_mpi4py=False, **kw)


@pytest.fixture(autouse=True)
def _no_scontrol(monkeypatch):
    monkeypatch.setattr("megatron_dppo.distributed.launch.shutil.which", lambda name: None)


# ------------------------------------------------------------------------------------------------ launchers
def test_single_process_defaults():
    assert discover({}) == LaunchInfo(0, 1, 0, 1, "127.0.0.1", 29500, "single")


def test_torchrun_worker():
    env = {"TORCHELASTIC_RUN_ID": "7", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "gpu01", "MASTER_PORT": "29400", **srun_task(1)}  # torchrun under srun: torchrun wins
    assert discover(env) == LaunchInfo(5, 8, 1, 4, "gpu01", 29400, "torchrun")


def test_torchrun_marker_without_rank_is_an_error():
    with pytest.raises(LaunchError, match="RANK/WORLD_SIZE"):
        discover({"TORCHELASTIC_RUN_ID": "7"})


@pytest.mark.parametrize("procid", range(4))
def test_srun_task_per_gpu(procid):
    info = discover(srun_task(procid))
    assert info == LaunchInfo(procid, 4, procid % 2, 2, "n1", slurm_master_port(1), "slurm")


def test_srun_master_from_the_step_nodelist_and_exported_values_win():
    env = {**srun_task(0), "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[01-08]"}
    assert discover(env).master_addr == "gpu07"
    env.update(MASTER_ADDR="10.0.0.9", MASTER_PORT="31000")
    info = discover(env)
    assert (info.master_addr, info.master_port) == ("10.0.0.9", 31000)


def test_srun_step_on_part_of_the_allocation_counts_the_step_tasks():
    env = {**srun_task(0), "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_GTIDS": "0,1"}
    assert (discover(env).world_size, discover(env).local_world_size) == (2, 2)


def test_srun_local_world_from_uneven_tasks_per_node_without_gtids():
    env = {**srun_task(0), "SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_NODEID": "1", "SLURM_PROCID": "3",
           "SLURM_LOCALID": "0"}
    del env["SLURM_GTIDS"]
    assert discover(env).local_world_size == 1


def test_batch_script_is_not_a_rank():
    """Slurm 22.05 gives the batch script SLURM_PROCID=0 and the job's SLURM_NTASKS but no SLURM_STEP_ID."""
    info = discover(BATCH_STEP)
    assert info.launcher == "single" and info.world_size == 1
    with pytest.raises(LaunchError, match="separate worlds"):
        check_single_world(info, BATCH_STEP)


@pytest.mark.parametrize("rank", range(4))
def test_mpirun_inside_an_allocation_uses_mpi_not_the_daemon_step(rank):
    """Regression: SLURM_PROCID/SLURM_NTASKS here are mpirun's daemon step (node index, node count)."""
    info = discover(mpirun_rank(rank))
    assert info == LaunchInfo(rank, 4, rank % 2, 2, "n1", slurm_master_port(1), "mpi")
    check_single_world(info, mpirun_rank(rank))


@pytest.mark.parametrize("procid", range(4))
def test_srun_mpi_pmix_direct_launch(procid):
    """`srun --mpi=pmix` exports PMIX_RANK but no size: the step's Slurm variables give the rest."""
    env = {**srun_task(procid), "PMIX_RANK": str(procid), "PMIX_NAMESPACE": "slurm.pmix.1.1"}
    assert discover(env) == LaunchInfo(procid, 4, procid % 2, 2, "n1", slurm_master_port(1), "mpi")


def test_srun_mpi_pmi2_direct_launch():
    env = {**srun_task(3), "PMI_RANK": "3", "PMI_SIZE": "4"}
    assert discover(env) == LaunchInfo(3, 4, 1, 2, "n1", slurm_master_port(1), "mpi")


def test_mpich_hydra_outside_slurm():
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "h0"}
    assert discover(env) == LaunchInfo(2, 4, 0, 2, "h0", 29500, "mpi")


def test_mpirun_on_one_host_needs_no_master_addr():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert discover(env).master_addr == "127.0.0.1"


def test_mpirun_over_hosts_without_master_addr_is_an_error():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        discover(env)


def test_pmix_rank_without_size_outside_slurm_is_an_error():
    with pytest.raises(LaunchError, match="no world size"):
        discover({"PMIX_RANK": "1"})


# -------------------------------------------------------------------------------------- export, validation
def test_export_then_rediscover_gives_the_same_answer():
    env = srun_task(2)
    first = discover_launch(env, use_mpi4py=False)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                "MASTER_PORT", "DPPO_LAUNCHER")} == {
        "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n1",
        "MASTER_PORT": str(slurm_master_port(1)), "DPPO_LAUNCHER": "slurm"}
    assert discover_launch(env, use_mpi4py=False) == first
    single = {}
    assert discover_launch(single, use_mpi4py=False) == discover_launch(single, use_mpi4py=False)
    assert discover_launch(single, use_mpi4py=False).launcher == "single"


def test_no_export_leaves_the_environment_alone():
    env = srun_task(1)
    discover_launch(env, export=False, use_mpi4py=False)
    assert env == srun_task(1)


def test_manual_env_launch():
    assert discover({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}) == LaunchInfo(
        1, 2, 0, 1, "h", 1234, "torchrun")


@pytest.mark.parametrize("env, match", [
    ({"RANK": "4", "WORLD_SIZE": "4"}, "outside the world"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "outside the world"),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "local rank 2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, "local rank 0 of 4"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
])
def test_inconsistent_environments_are_rejected(env, match):
    with pytest.raises(LaunchError, match=match):
        discover(env)


def test_launch_error_is_a_value_error():
    assert issubclass(LaunchError, ValueError)


# ------------------------------------------------------------------------------------ check_single_world
def test_srun_torchrun_standalone_makes_separate_worlds():
    """`srun -N2 torchrun --standalone --nproc-per-node=2`: each agent's world holds only its own 2 workers."""
    env = {**srun_task(0), "SLURM_STEP_NUM_TASKS": "2", "TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2",
           "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    with pytest.raises(LaunchError, match="every agent built its own world"):
        check_single_world(discover(env), env)
    env.update(WORLD_SIZE="4")  # a shared c10d rendezvous over both agents is fine
    check_single_world(discover(env), env)


def test_torchrun_in_the_batch_script_is_not_checked_against_the_job():
    env = {**BATCH_STEP, "TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    check_single_world(discover(env), env)


def test_world_of_one_in_a_multi_task_step_is_refused():
    env = {**srun_task(0), "RANK": "0", "WORLD_SIZE": "1"}
    info = LaunchInfo(0, 1, 0, 1, "n1", 20001, "mpi")  # e.g. an MPI singleton under srun --mpi=none
    with pytest.raises(LaunchError, match="4 separate worlds"):
        check_single_world(info, env)


def test_consistent_launches_pass_the_check():
    for env in (srun_task(0), srun_task(3), {}, {**SLURM_JOB, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}):
        check_single_world(discover(env), env)


def test_check_compares_with_an_initialized_mpi(monkeypatch):
    class FakeComm:
        @staticmethod
        def Get_size():
            return 1

    class FakeMPI:
        COMM_WORLD = FakeComm

        @staticmethod
        def Is_initialized():
            return True

        @staticmethod
        def Is_finalized():
            return False

    monkeypatch.setitem(__import__("sys").modules, "mpi4py.MPI", FakeMPI)
    env = srun_task(1)
    with pytest.raises(LaunchError, match="MPI's world has 1 process"):
        check_single_world(discover(env), env)


# --------------------------------------------------------------------------------------- Slurm helpers
@pytest.mark.parametrize("nodelist, hosts", [
    ("n[1-2]", ["n1", "n2"]),
    ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("a1,b[1-2]-ib", ["a1", "b1-ib", "b2-ib"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("single", ["single"]),
    ("", []),
])
def test_parse_slurm_nodelist(nodelist, hosts):
    assert parse_slurm_nodelist(nodelist) == hosts
    assert expand_slurm_nodelist(nodelist) == hosts  # scontrol is hidden by the fixture: the Python parser


@pytest.mark.parametrize("bad", ["n[1-2", "n1-2]", "n[a-b]", "n[3-1]"])
def test_parse_slurm_nodelist_rejects_malformed(bad):
    with pytest.raises(LaunchError):
        parse_slurm_nodelist(bad)


def test_parse_tasks_per_node():
    assert parse_slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_slurm_tasks_per_node("8") == [8]
    with pytest.raises(LaunchError, match="tasks-per-node"):
        parse_slurm_tasks_per_node("2(3)")


def test_master_port_from_job_id_matches_the_sbatch_formula():
    assert slurm_master_port(None) == 29500
    assert slurm_master_port(1) == 20001
    assert slurm_master_port(20000) == 20000 and slurm_master_port(123456) == 20000 + 123456 % 20000
    assert all(20000 <= slurm_master_port(j) < 40000 for j in (0, 1, 19999, 10**9 + 7))


def test_free_port():
    assert 0 < free_port() < 65536


def test_stop_requested_follows_the_stop_file(tmp_path):
    from megatron_dppo.distributed.launch import stop_requested

    flag = tmp_path / "stop-requested"
    env = {"DPPO_STOP_FILE": str(flag)}
    assert not stop_requested(env) and not stop_requested({})
    flag.touch()
    assert stop_requested(env)
    assert not stop_requested({"DPPO_STOP_FILE": ""})


def test_launch_check_resumes_from_the_newest_complete_step_whatever_latest_says(tmp_path):
    """The self-test's checkpoints follow the trainer's rule: a kill between renaming step 3 into place and updating
    ``latest`` (still naming step 2) resumes from step 3; an unfinished temporary step is never taken."""
    from megatron_dppo.distributed.launch_check import load_latest, save_checkpoint

    assert load_latest(tmp_path) is None
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, {"step": step, "total": float(step)})
    (tmp_path / "latest").write_text("step-000002")
    (tmp_path / ".step-000004.tmp").mkdir()
    assert load_latest(tmp_path)["step"] == 3
